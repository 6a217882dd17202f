"""Redis replies as text: redis-py gives bytes unless a client decodes responses, and the farm's
clients do not (token payloads and KV blobs are binary), so names, ids and fields read back
are turned into str here, one way for every module of broker/."""

from __future__ import annotations

from typing import Any


def as_text(value: Any) -> str:
    """bytes decoded as UTF-8 (an undecodable byte becomes U+FFFD, never an error: the value
    may come from outside the farm), None as "", anything else as str()."""
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).decode("utf-8", "replace")
    return "" if value is None else str(value)
