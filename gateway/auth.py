"""API keys: when any are configured, /v1/* requires `Authorization: Bearer <key>`."""

from __future__ import annotations

import hmac

from fastapi import Request
from syshax.api.errors import APIError


def check_api_key(request: Request, api_keys: list[str]) -> None:
    """Raise a 401 (OpenAI's shape) unless the request carries one of `api_keys`."""
    if not api_keys:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    token = token.strip()
    if scheme.lower() == "bearer" and token:
        # compare_digest against every key: the time taken does not tell which one matched
        matched = [hmac.compare_digest(token.encode(), k.encode()) for k in api_keys]
        if any(matched):
            return
        message = "Incorrect API key provided."
    else:
        message = "Missing API key: send it as `Authorization: Bearer <key>`."
    raise APIError(
        401,
        message,
        type="invalid_request_error",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )
