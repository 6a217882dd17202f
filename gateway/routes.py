"""The gateway's routes, by group: the OpenAI-compatible API (generation, resume, tokenize,
models), which needs an API key, and the open status endpoints (/health, /metrics)."""

from __future__ import annotations

from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response
from syshax.api.schemas import ChatCompletionRequest, CompletionRequest
from syshax.api.tokenize import DetokenizeRequest, TokenizeRequest, detokenize, tokenize

from . import status
from .auth import check_api_key
from .service import Gateway


def add_api_routes(app: FastAPI, gw: Gateway) -> None:
    """POST /v1/chat/completions, POST /v1/completions, GET /v1/requests/{request_id}/stream,
    POST /tokenize, POST /detokenize, GET /v1/models."""

    # async: FastAPI runs a plain-function dependency in its thread pool, a thread hand-off
    # (wake a worker thread, wait for it) per request for a few string compares.
    async def authenticated(request: Request) -> None:
        check_api_key(request, gw.settings.api_keys)

    auth = [Depends(authenticated)]  # a dependency: runs before the body is validated

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        route = gw.router.pick(body.model)
        return await gw.run(request, await route.preparer.chat(body), route)

    @app.post("/v1/completions", dependencies=auth)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        route = gw.router.pick(body.model)
        return await gw.run(request, await route.preparer.completion(body), route)

    @app.get("/v1/requests/{request_id}/stream", dependencies=auth)
    async def resume_stream(request_id: str, request: Request) -> Response:
        return await gw.resume(request, request_id)

    @app.post("/tokenize", dependencies=auth)
    async def tokenize_route(body: TokenizeRequest) -> dict[str, Any]:
        return await tokenize(gw.router.pick(body.model).preparer, body)

    @app.post("/detokenize", dependencies=auth)
    async def detokenize_route(body: DetokenizeRequest) -> dict[str, Any]:
        return await detokenize(gw.router.pick(body.model).preparer, body)

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict[str, Any]:
        live = None  # one model: always listed
        if len(gw.router.routes) > 1:  # several: those a live worker serves
            assert gw.broker is not None
            live = {str(w.get("model", "")) for w in await gw.broker.workers()}
        return {"object": "list", "data": gw.router.cards(live)}


def add_status_routes(app: FastAPI, gw: Gateway) -> None:
    """GET /health and GET /metrics (no API key: load balancers and Prometheus probe them)."""

    @app.get("/health")
    async def health() -> Response:
        return await status.health(gw)

    @app.get("/metrics")
    async def metrics() -> Response:
        return await status.scrape(gw)
