"""Run the gateway with uvicorn: `serve(settings)` (used by `syshax gateway`).

uvicorn handles SIGINT/SIGTERM: it stops accepting connections, lets open requests (streams
included) finish for up to `settings.shutdown_timeout` seconds, then runs the app's shutdown
(which closes the broker connections).
"""

from __future__ import annotations

import logging

import uvicorn
from fastapi import FastAPI

from .app import create_app
from .settings import GatewaySettings

log = logging.getLogger(__name__)


def uvicorn_config(
    settings: GatewaySettings, app: FastAPI | None = None, log_level: str = "info"
) -> uvicorn.Config:
    return uvicorn.Config(
        app if app is not None else create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=log_level,
        lifespan="on",
        timeout_graceful_shutdown=settings.shutdown_timeout,
        access_log=log_level == "debug",
    )


def serve(settings: GatewaySettings, app: FastAPI | None = None, log_level: str = "info") -> None:
    """Serve until SIGINT/SIGTERM (blocking)."""
    server = uvicorn.Server(uvicorn_config(settings, app, log_level))
    log.info("gateway on http://%s:%d (model %s)", settings.host, settings.port, settings.model)
    server.run()
