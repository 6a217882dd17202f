"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Every failure path of the gateway ends here: our own `APIError`s, FastAPI's validation errors
(400, not 422: OpenAI clients expect 400 with the offending `param`), unknown routes, Redis
outages (503 + Retry-After) and unexpected exceptions (500, logged with the traceback).
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError as RedisOutOfMemory
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)

REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, ConnectionError, TimeoutError)
BROKER_ERRORS = (*REDIS_DOWN, RedisOutOfMemory)  # answered 503 by `broker_error`

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
    504: "timeout",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str | None = None,
        param: str | None = None,
        code: str | int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPES.get(status, "api_error")
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(
    message: str, type: str, param: str | None = None, code: str | int | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


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


def worker_error(error: dict[str, Any] | None) -> APIError:
    """A TokenEvent.error ({"message", "type", "code"}) as an HTTP error: the code when it is an
    HTTP status, else by type (overload/unavailable -> 503, timeout -> 504, else 500)."""
    error = error if isinstance(error, dict) else {}
    message = str(error.get("message") or "the worker failed to generate")
    etype = str(error.get("type") or "internal_error")
    code = error.get("code")
    if isinstance(code, int) and not isinstance(code, bool) and 400 <= code <= 599:
        status = code
    elif etype in ("overloaded", "service_unavailable", "unavailable"):
        status = 503
    elif etype in ("timeout", "deadline_exceeded"):
        status = 504
    elif etype == "invalid_request_error":
        status = 400
    else:
        status = 500
    headers = {"Retry-After": "1"} if status in (429, 503) else None
    return APIError(status, message, etype, None, code, headers)


_UNION_TAG = re.compile(r"^(str|int|float|bool|none|list|dict)$|[\[\]-]")


def _param(loc: tuple[Any, ...]) -> str | None:
    """OpenAI's `param` from a pydantic error location: ("body", "messages", 0, "role") ->
    "messages[0].role"; union-member tags ("str", "list[int]") are dropped."""
    parts = [p for p in loc if p != "body" and not (isinstance(p, str) and _UNION_TAG.search(p))]
    if not parts:
        return None
    out = str(parts[0])
    for p in parts[1:]:
        out += f"[{p}]" if isinstance(p, int) else f".{p}"
    return out


def validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") in ("json_invalid", "json_type"):
        detail = (first.get("ctx") or {}).get("error") or first.get("msg", "")
        return APIError(400, f"invalid JSON body: {detail}", code="invalid_json")
    if first.get("type") == "missing" and tuple(first.get("loc", ())) == ("body",):
        return APIError(400, "the request body is required (a JSON object)", code="invalid_json")
    if first.get("type") == "model_attributes_type" and tuple(first.get("loc", ())) == ("body",):
        return APIError(
            400,
            "the request body must be a JSON object (Content-Type: application/json)",
            code="invalid_json",
        )
    param = _param(tuple(first.get("loc", ())))
    # A union (e.g. prompt: string | list) reports one error per member: say them together.
    same = [e for e in errors if _param(tuple(e.get("loc", ()))) == param]
    msgs = [str(e.get("msg", "invalid value")).removeprefix("Value error, ") for e in same]
    msgs = list(dict.fromkeys(msgs))
    message = "; or ".join(msgs)
    message = f"{param}: {message}" if param else message
    others = len(errors) - len(same)
    if others:
        message += f" (and {others} more error(s))"
    return APIError(400, message, param=param, code="invalid_value")


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

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
        return APIError(exc.status_code, message, code=code, headers=headers).response()

    for cls in (RedisConnectionError, RedisTimeoutError, RedisOutOfMemory):

        @app.exception_handler(cls)
        async def _redis_down(request: Request, exc: Exception) -> JSONResponse:
            return broker_error(exc).response()

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

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

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
