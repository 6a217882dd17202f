"""Run the gateway with uvicorn: `serve(settings)` (used by `syshax gateway`).

uvicorn handles SIGINT/SIGTERM: it stops accepting connections, lets open requests (streams
included) finish for up to `settings.shutdown_timeout` seconds, then runs the app's shutdown
(which closes the broker connections).
"""

from __future__ import annotations

import gc
import logging
import socket

import uvicorn
from fastapi import FastAPI
from syshax.shared.net import is_loopback

from .app import create_app
from .settings import GatewaySettings

log = logging.getLogger(__name__)

# uvloop's event loop and httptools' HTTP parser instead of asyncio's loop and the pure-Python
# h11: the gateway's CPU per streamed token falls by ~35% (bench/broker.py, docs/benchmarks.md).
try:
    import uvloop  # noqa: F401

    LOOP = "uvloop"
except ImportError:  # a platform without it (Windows): asyncio's own loop
    LOOP = "asyncio"
try:
    import httptools  # noqa: F401

    HTTP = "httptools"
except ImportError:
    HTTP = "h11"


def uvicorn_config(
    settings: GatewaySettings, app: FastAPI | None = None, log_level: str = "info"
) -> uvicorn.Config:
    return uvicorn.Config(
        app if app is not None else create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=log_level,
        lifespan="on",
        loop=LOOP,
        http=HTTP,
        timeout_graceful_shutdown=settings.shutdown_timeout,
        access_log=log_level == "debug",
    )


def warn_if_open(settings: GatewaySettings) -> bool:
    """Log one WARNING when the gateway binds beyond loopback with no API key: every /v1 route
    is then open to whoever can reach the port. Returns whether it warned."""
    if settings.api_keys or is_loopback(settings.host):
        return False
    log.warning(
        "the gateway listens on %s:%d with no API keys: anyone who can reach that address can "
        "use the API. Set keys with `syshax config api_keys KEY1,KEY2` (or --api-key KEY), "
        "or bind to 127.0.0.1 (`syshax config gateway.host 127.0.0.1`)",
        settings.host,
        settings.port,
    )
    return True


def serve(
    settings: GatewaySettings,
    app: FastAPI | None = None,
    log_level: str = "info",
    reuse_port: bool = False,
) -> None:
    """Serve until SIGINT/SIGTERM (blocking). `reuse_port`: bind with SO_REUSEPORT, so several
    gateway processes share one port (the kernel spreads connections over them)."""
    server = uvicorn.Server(uvicorn_config(settings, app, log_level))
    # Everything imported and built so far lives as long as the process: frozen, a full
    # collection no longer walks it (a full collection of the gateway's heap took ~16 ms under
    # load, a stall every stream of this gateway sees as a late token). As the workers do.
    gc.freeze()
    warn_if_open(settings)
    log.info("gateway on http://%s:%d (model %s)", settings.host, settings.port, settings.model)
    server.run(sockets=[shared_socket(settings.host, settings.port)] if reuse_port else None)


def shared_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound with SO_REUSEPORT: every process that binds the same address this
    way gets its own accept queue, and Linux hashes each new connection to one of them. Each
    gateway has its own id and channel (broker/client.py); any of them serves any resume."""
    if not hasattr(socket, "SO_REUSEPORT"):
        raise OSError("SO_REUSEPORT is not available on this platform")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock
