"""A cap on request body size: larger bodies get 413 in OpenAI's error shape, without being
read into memory (a declared Content-Length is refused at once; a chunked body is counted as
it arrives and refused when it passes the limit)."""

from __future__ import annotations

import json
from collections.abc import Awaitable

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from syshax.api.errors import error_body

DEFAULT_MAX_BODY_BYTES = 10 * 2**20


def too_large_message(limit: int) -> str:
    return f"the request body is larger than {limit} bytes"


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.max_bytes <= 0:
            await self.app(scope, receive, send)
            return
        limit = self.max_bytes
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > limit:
                    await _reject(send, limit)
                    return
        received = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    # Raised where the app reads its body: FastAPI re-raises HTTPExceptions
                    # from there, and errors.install's handler shapes it.
                    raise HTTPException(413, too_large_message(limit))
            return message

        def tracking_send(message: Message) -> Awaitable[None]:  # per SSE chunk: no coroutine
            nonlocal started
            started = started or message["type"] == "http.response.start"
            return send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except HTTPException as exc:
            if exc.status_code != 413 or started:
                raise
            await _reject(send, limit)


async def _reject(send: Send, limit: int) -> None:
    body = json.dumps(
        error_body(too_large_message(limit), "invalid_request_error", None, "request_too_large")
    ).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    # The rest of the body is not read: the client must not reuse this connection.
    headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": 413, "headers": headers})
    await send({"type": "http.response.body", "body": body})
