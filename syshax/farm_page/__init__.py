"""The dashboard's web app: rq-dashboard's pages (batch jobs) and the Farm page (streams,
workers, dispatcher, KV leases, ITL tails, dead letters) in one Flask app, under one basic
auth. `syshax dashboard` serves it; `make_app` builds it (tests use Flask's client on it)."""

from .app import FarmPageSettings, make_app

__all__ = ["FarmPageSettings", "make_app"]
