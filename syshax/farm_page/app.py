"""One Flask app: rq-dashboard's blueprint and the Farm page's, behind one basic auth.

rq-dashboard's own `make_flask_app` adds its auth to its module-level blueprint (every app
built in a process would pile up checks); here the check is the app's own, so it covers both
pages, their JSON and their static files alike. The Farm link is put into rq-dashboard's
navigation bar by rewriting its HTML responses (rq-dashboard has no hook for extra pages);
were its markup to change, the link goes at the top of the page instead, never nowhere.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from pathlib import Path

from flask import Flask, Response, request, url_for

from syshax.broker.keys import KEYS, Keys

NAV_MARKER = '<ul class="navbar-nav mr-auto">'


@dataclass
class FarmPageSettings:
    redis_url: str
    keys: Keys = field(default_factory=lambda: KEYS)
    kv_ttl: float = 120.0  # kv.ttl: a lease's age is this less its time to expiry
    username: str = ""  # basic auth when a password is set
    password: str = ""
    url_prefix: str = ""
    poll_ms: int = 1000  # how often the pages refresh themselves
    models: tuple[str, ...] = ("",)  # the stream keys of the farm's models ("" = the one's)
    jobs: str = "redis"  # broker.jobs: amqp = the job queues' depths are RabbitMQ's
    amqp_url: str = ""  # broker.amqp_url ("" = the default)


def make_app(settings: FarmPageSettings) -> Flask:
    """The dashboard app on the farm's Redis: rq-dashboard's pages at the prefix's root, the
    Farm page at <prefix>/farm."""
    from rq.serializers import JSONSerializer
    from rq_dashboard import default_settings
    from rq_dashboard.web import blueprint as rq_blueprint
    from rq_dashboard.web import config as rq_config
    from rq_dashboard.web import setup_rq_connection

    from .views import farm

    # The app's /static is rq-dashboard's own folder (as in its own app): the route shadows
    # the blueprint's at the same path, and rq's pages ask for `url_for('static', ...)`.
    app = Flask(__name__, static_folder=str(Path(rq_blueprint.root_path) / "static"))
    app.config.from_object(default_settings)
    app.config["RQ_DASHBOARD_REDIS_URL"] = settings.redis_url
    app.config["RQ_DASHBOARD_POLL_INTERVAL"] = settings.poll_ms
    app.config["RQ_DASHBOARD_DISABLE_DELETE"] = False
    app.config["DEPRECATED_OPTIONS"] = []
    app.config["FARM_PAGE"] = settings
    rq_config.serializer = JSONSerializer  # batch jobs are never pickled
    if settings.password:
        _require_basic_auth(app, settings.username or "admin", settings.password)
    app.register_blueprint(rq_blueprint, url_prefix=settings.url_prefix)
    app.register_blueprint(farm, url_prefix=f"{settings.url_prefix}/farm")
    app.after_request(_link_farm_page)
    setup_rq_connection(app)
    return app


def _require_basic_auth(app: Flask, username: str, password: str) -> None:
    user_b, password_b = username.encode(), password.encode()

    @app.before_request
    def basic_auth() -> Response | None:
        auth = request.authorization
        given_user = (auth.username or "").encode() if auth else b""
        given_password = (auth.password or "").encode() if auth else b""
        # Both compared in constant time, both always: no timing tells which one was wrong.
        ok_user = secrets.compare_digest(given_user, user_b)
        ok_password = secrets.compare_digest(given_password, password_b)
        if auth is None or not (ok_user and ok_password):
            return Response(
                "The sysHAX dashboard needs a login.\n",
                401,
                {"WWW-Authenticate": 'Basic realm="sysHAX dashboard"'},
            )
        return None


def _link_farm_page(response: Response) -> Response:
    """A 'Farm' entry in rq-dashboard's navigation bar, on its HTML pages."""
    if request.blueprint != "rq_dashboard" or response.mimetype != "text/html":
        return response
    if response.direct_passthrough or response.status_code != 200:
        return response
    html = response.get_data(as_text=True)
    href = url_for("farm.page")
    item = f'<li class="nav-item"><a href="{href}" class="nav-link" id="farm-link">Farm</a></li>'
    if NAV_MARKER in html:
        html = html.replace(NAV_MARKER, NAV_MARKER + item, 1)
    elif "<body>" in html:
        bar = f'<div style="padding:4px 12px"><a href="{href}" id="farm-link">Farm page</a></div>'
        html = html.replace("<body>", "<body>" + bar, 1)
    response.set_data(html)
    return response
