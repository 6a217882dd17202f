"""The one rule for "is this worker alive", shared by the workers (who claim a dead worker's
jobs), the gateway (/health, /metrics) and `syshax top`.

Each worker rewrites its heartbeat hash every beat with `last_seen` and its own TTL (`ttl`,
`syshax worker --heartbeat-ttl`) and sets the hash to expire after that TTL. A worker is alive
while its hash exists and its last beat is younger than its own TTL; readers never apply a
fixed timeout of their own, so a worker started with a long TTL is not declared dead early.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

HEARTBEAT_TTL = 10  # seconds (default): a worker silent this long is dead (its jobs get reclaimed)


def heartbeat_ttl(info: Mapping[str, Any]) -> float:
    """The heartbeat TTL a worker announced (older workers did not: the default)."""
    try:
        return float(info.get("ttl", HEARTBEAT_TTL))
    except (TypeError, ValueError):
        return float(HEARTBEAT_TTL)


def is_alive(info: Mapping[str, Any], now: float | None = None) -> bool:
    """Whether the worker behind this heartbeat hash is alive at `now` (default: the time now).
    An empty hash (expired) or an unreadable `last_seen` is dead."""
    if not info:
        return False
    try:
        last_seen = float(info.get("last_seen", 0))
    except (TypeError, ValueError):
        return False
    return (time.time() if now is None else now) - last_seen < heartbeat_ttl(info)
