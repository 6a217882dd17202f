"""Log levels: `syshax` starts every command at WARNING (one-shot commands print their own
results); the long-running ones (run, worker, gateway, the batch worker) then apply the config's
`log_level`. DEBUG=1 wins over both. Children of `syshax run` load the same config file, so one
key sets the whole farm's level."""

from __future__ import annotations

import logging

from . import env

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def start_level() -> int:
    """The level every command starts at (raises env.EnvError for a bad DEBUG)."""
    return logging.DEBUG if env.debug() else logging.WARNING


def service_level(log_level: str) -> str:
    """The level name a long-running command runs at: DEBUG=1 forces debug, else the config's
    `log_level` (debug | info | warning | error | critical)."""
    return "debug" if env.debug() else log_level.lower()


def apply_log_level(log_level: str) -> str:
    """Set the root logger to `service_level(log_level)`; returns the level name (for uvicorn,
    rq and the lines that say what runs)."""
    name = service_level(log_level)
    logging.getLogger().setLevel(name.upper())
    return name
