"""Errors in OpenAI's shape (`syshax.api.errors`) as the gateway's HTTP responses.

Every failure path of the gateway ends here: our own `APIError`s, FastAPI's validation errors
(400, not 422: OpenAI clients expect 400 with the offending `param`), unknown routes, Redis
outages (503 + Retry-After) and unexpected exceptions (500, logged with the traceback).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError as RedisOutOfMemory
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from syshax.api.errors import APIError, validation_error

log = logging.getLogger(__name__)

REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, ConnectionError, TimeoutError)
BROKER_ERRORS = (*REDIS_DOWN, RedisOutOfMemory)  # answered 503 by `broker_error`


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def broker_error(exc: Exception) -> APIError:
    """A client's answer to a failed broker call: what is down, never where (the exception
    names Redis's address; it goes to the log)."""
    if isinstance(exc, RedisOutOfMemory):  # maxmemory reached (noeviction): shed load
        log.warning("Redis is full (maxmemory): %s", exc)
        return unavailable("the message broker is out of memory; retry shortly")
    log.warning("Redis unavailable: %s", exc)
    return unavailable("the message broker is unavailable; retry shortly")


def unavailable(message: str, retry_after: int = 1) -> APIError:
    return APIError(
        503, message, code="service_unavailable", headers={"Retry-After": str(retry_after)}
    )


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail) if exc.detail else "error"
        code = None
        if exc.status_code == 404:
            message = f"no such route: {request.method} {request.url.path}"
        elif exc.status_code == 413:
            code = "request_too_large"
        elif exc.status_code == 400 and message == "There was an error parsing the body":
            # FastAPI's answer to a body json.loads cannot even read (e.g. invalid UTF-8).
            message, code = "the request body is not valid JSON text (UTF-8)", "invalid_json"
        headers = dict(exc.headers or {})
        return error_response(APIError(exc.status_code, message, code=code, headers=headers))

    for cls in (RedisConnectionError, RedisTimeoutError, RedisOutOfMemory):

        @app.exception_handler(cls)
        async def _redis_down(request: Request, exc: Exception) -> JSONResponse:
            return error_response(broker_error(exc))

    app.add_middleware(CatchAllMiddleware)


class CatchAllMiddleware:
    """Turns an unexpected exception into a 500 in OpenAI's shape (logged with traceback),
    instead of Starlette's plain-text 500. Once a response has started, nothing can be sent."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        def tracking_send(message: Message) -> Awaitable[None]:  # per SSE chunk: no coroutine
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            return send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            if isinstance(exc, BROKER_ERRORS) and not started:
                err = broker_error(exc)
            else:
                log.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
                if started:
                    return
                err = APIError(500, f"internal error: {type(exc).__name__}", code="internal_error")
            body = json.dumps(err.body()).encode()
            headers = [
                (b"content-type", b"application/json"),
                (b"content-length", b"%d" % len(body)),
            ]
            headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
            await send({"type": "http.response.start", "status": err.status, "headers": headers})
            await send({"type": "http.response.body", "body": body})
