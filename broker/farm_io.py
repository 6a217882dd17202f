"""A synchronous client's side of the farm's streams (the batch client, batch/farm_client.py):
queue prefill jobs, cancel them, read their output streams. The gateway does the same over
asyncio in client.py."""

from __future__ import annotations

from collections.abc import Iterable

import redis

from .keys import Keys
from .schemas import PrefillJob, SchemaError, TokenEvent


def queue_jobs(r: redis.Redis, stream: str, jobs: Iterable[PrefillJob]) -> None:
    with r.pipeline(transaction=False) as pipe:
        for job in jobs:
            pipe.xadd(stream, {"j": job.pack()})
        pipe.execute()


def cancel_jobs(r: redis.Redis, keys: Keys, ids: list[str], ttl: int) -> None:
    """Flag each job cancelled (for a queued one) and publish it (for a running one)."""
    with r.pipeline(transaction=False) as pipe:
        for jid in ids:
            pipe.set(keys.cancel_flag(jid), 1, ex=max(1, ttl))
            pipe.publish(keys.cancel_channel, jid)
        pipe.execute()


def last_event(r: redis.Redis, keys: Keys, job_id: str) -> TokenEvent | None:
    last = r.xrevrange(keys.output_stream(job_id), count=1)
    return TokenEvent.unpack(last[0][1][b"e"]) if last else None


def _event(fields: dict) -> TokenEvent | None:
    try:
        return TokenEvent.unpack(fields[b"e"])
    except (SchemaError, KeyError):
        return None  # not an event this version can read: skipped, its cursor passed


def read_outputs(
    r: redis.Redis, cursors: dict[str, str], block_ms: int
) -> list[tuple[str, list[tuple[str, TokenEvent | None]]]]:
    """New entries of output streams after their cursors: [(stream, [(entry id, event or
    None for an unreadable entry)])]."""
    out = []
    for name, entries in r.xread(cursors, count=1024, block=max(1, block_ms)) or []:
        stream = name.decode() if isinstance(name, bytes) else name
        events = [
            (eid.decode() if isinstance(eid, bytes) else eid, _event(f)) for eid, f in entries
        ]
        out.append((stream, events))
    return out
