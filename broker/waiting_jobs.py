"""What waits in a worker's streams for someone to take it: the entries pending under
consumers whose heartbeat is gone, oldest first (WorkQueues.claim_orphans takes them), and
those nobody has read yet.

XPENDING's summary names the consumers with entries pending; only the dead ones' entries are
listed. (The extended form over the whole group returned the oldest 100 entries of every
consumer, live ones included: past 100 pending jobs, a dead worker's were not seen at all.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import redis

from .text import as_text

# The most entries one dead consumer's listing returns: more than any worker holds.
PER_CONSUMER = 1000


def _order(entry_id: bytes | str) -> tuple[int, int]:
    ms, _, seq = as_text(entry_id).partition("-")
    return int(ms), int(seq or 0)


def _per_stream(r: redis.Redis, streams: list[str], add: Callable[[Any, str], Any]) -> list:
    """One command per stream (`add(pipe, stream)`) in one round trip; None for a stream
    whose command failed with a reply error (no stream or group yet)."""
    pipe = r.pipeline(transaction=False)
    for stream in streams:
        add(pipe, stream)
    replies = pipe.execute(raise_on_error=False)
    return [None if isinstance(reply, redis.ResponseError) else reply for reply in replies]


def pending_summaries(r: redis.Redis, streams: list[str], group: str) -> list[dict | None]:
    """XPENDING's summary of each of `streams`, in one round trip: a claim round looks at
    every stream a worker serves, and the round trips of a claim round that falls between two
    tokens of a stream are that gap's (docs/benchmarks.md)."""
    return _per_stream(r, streams, lambda pipe, stream: pipe.xpending(stream, group))


def pending_of(
    r: redis.Redis, streams: list[str], group: str, consumer: str, count: int = 100
) -> list[list[dict] | None]:
    """The entries pending under `consumer` in each of `streams` (XPENDING's extended form),
    in one round trip."""
    return _per_stream(
        r,
        streams,
        lambda pipe, stream: pipe.xpending_range(
            stream, group, "-", "+", count, consumername=consumer
        ),
    )


def dead_pending(
    r: redis.Redis, stream: str, group: str, summary: dict | None, consumer: str, live: set[str]
) -> list[bytes | str]:
    """The ids of `stream`'s entries pending under consumers neither live nor `consumer`,
    oldest first (`summary`: the stream's `pending_summaries`)."""
    dead = [
        as_text(c["name"])
        for c in (summary or {}).get("consumers") or []
        if as_text(c["name"]) not in live and as_text(c["name"]) != consumer
    ]
    ids: list[bytes | str] = []
    for name in dead:
        rows = r.xpending_range(stream, group, "-", "+", PER_CONSUMER, consumername=name)
        ids += [p["message_id"] for p in rows]
    return sorted(ids, key=_order)


def unread(r: redis.Redis, streams: list[str], group: str) -> int:
    """Entries of `streams` no consumer of `group` has read yet: their length less those
    pending (an entry is deleted when it is acked)."""
    pipe = r.pipeline(transaction=False)
    for stream in streams:
        pipe.xlen(stream)
        pipe.xpending(stream, group)
    replies = pipe.execute(raise_on_error=False)
    total = 0
    for length, pending in zip(replies[::2], replies[1::2], strict=True):
        read = 0 if isinstance(pending, redis.ResponseError) else int(pending.get("pending") or 0)
        total += max(int(length) - read, 0)  # (an error on XPENDING: no group, none read)
    return total
