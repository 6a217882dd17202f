"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

`APIError` is every refusal of a request, with the HTTP status it is answered with: the gateway
sends it as a response (gateway/errors.py installs the handlers), a batch job writes its body
into the output line. The wording of a body the schemas refuse and of a worker's error event
lives here too, so both answer alike.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

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


def error_body(
    message: str, type: str, param: str | None = None, code: str | int | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


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


def validation_error(errors: Sequence[Any]) -> APIError:
    """A 400 for a refused request body, from pydantic's error dicts located as FastAPI locates
    them (("body", field, ...); `RequestValidationError.errors()`)."""
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


def body_error(exc: ValidationError) -> APIError:
    """`validation_error` for a body validated outside FastAPI (a batch line): its errors are
    located in "body" as FastAPI locates them, so the 400 is worded exactly as the gateway's."""
    return validation_error([{**e, "loc": ("body", *e.get("loc", ()))} for e in exc.errors()])
