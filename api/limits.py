"""Bounds on what one request may carry (`limits.*` in the config).

Each list or map a request can send costs work per token or per step somewhere: stop strings
are matched against every generated token of every sequence on the engine's thread, messages
and their parts go through the chat template, tool and logit_bias tables travel with every
job. The body-size cap alone would let 10,000 one-character stop strings through. So each is
bounded here, before anything is tokenized or queued, with a 400 naming the field and the limit.
"""

from __future__ import annotations

from typing import Any

from syshax.shared.config_schema import LimitsConfig

from .errors import APIError


def _too_many(param: str, count: int, limit: int, what: str) -> APIError:
    return APIError(
        400,
        f"{param}: at most {limit} {what} per request (got {count}); the server's limits.* "
        "settings set these bounds",
        param=param,
        code="too_many_items",
    )


def check_bounds(body: Any, limits: LimitsConfig) -> None:
    """Raise APIError(400) for the first field of a validated request body over its bound."""
    stops = body.stop or []
    if len(stops) > limits.stop_strings:
        raise _too_many("stop", len(stops), limits.stop_strings, "stop strings")
    for i, stop in enumerate(stops):
        if len(stop) > limits.stop_chars:
            raise APIError(
                400,
                f"stop[{i}]: a stop string may hold at most {limits.stop_chars} characters "
                f"(got {len(stop)})",
                param="stop",
                code="string_too_long",
            )
    # (A completions body may carry a stray `messages` among its unknown fields: not ours.)
    messages = body.messages if "messages" in type(body).model_fields else []
    if len(messages) > limits.messages:
        raise _too_many("messages", len(messages), limits.messages, "messages")
    for i, message in enumerate(messages):
        if isinstance(message.content, list) and len(message.content) > limits.content_parts:
            raise _too_many(
                f"messages[{i}].content", len(message.content), limits.content_parts, "parts"
            )
    for name, limit in (("tools", limits.tools), ("logit_bias", limits.logit_bias)):
        value = getattr(body, name, None)  # (a completions body has no tools)
        if isinstance(value, (list, dict)) and len(value) > limit:
            raise _too_many(name, len(value), limit, "entries")
