"""The gateway app: `create_app(settings)` -> FastAPI (serve it with uvicorn, see server.py).

Routes (routes.py): POST /v1/chat/completions, POST /v1/completions, GET /v1/models,
GET /v1/requests/{request_id}/stream (SSE resume), POST /tokenize, POST /detokenize,
GET /health, GET /metrics. The request handling is the `Gateway` (service.py).
"""

from __future__ import annotations

from contextlib import asynccontextmanager

import redis.asyncio as aioredis
from fastapi import FastAPI
from syshax.shared.tokenizer import Tokenizer

from . import errors
from .body_limit import BodyLimitMiddleware
from .metrics import RequestMetricsMiddleware
from .routes import add_api_routes, add_status_routes
from .service import Gateway
from .settings import GatewaySettings


def create_app(
    settings: GatewaySettings,
    redis: aioredis.Redis | None = None,
    *,
    tokenizer: Tokenizer | None = None,
) -> FastAPI:
    """The gateway app. `redis`: an async client (decode_responses=False) to use instead of
    one made from settings.redis_url; `tokenizer`: a loaded tokenizer of settings.model."""
    tokenizer = tokenizer or Tokenizer.from_model_path(settings.model_path())
    gw = Gateway(settings, tokenizer, redis)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await gw.start()
        try:
            yield
        finally:
            await gw.stop()

    app = FastAPI(title="sysHAX gateway", lifespan=lifespan)
    app.state.gateway = gw
    errors.install(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(RequestMetricsMiddleware, metrics=gw.metrics)  # outermost: counts all
    add_api_routes(app, gw)
    add_status_routes(app, gw)
    return app
