"""A synchronous client's side of the farm's streams (the batch client, batch/farm_client.py):
queue prefill jobs, cancel them, read their output streams. The gateway does the same over
asyncio in client.py."""

from __future__ import annotations

import time
from collections.abc import Iterable

import redis
from redis.crc import key_slot

from .connect import clustered, publish
from .keys import Keys
from .schemas import PrefillJob, SchemaError, TokenEvent, entry_events


def queue_jobs(r: redis.Redis, stream: str, jobs: Iterable[PrefillJob]) -> None:
    with r.pipeline(transaction=False) as pipe:
        for job in jobs:
            pipe.xadd(stream, {"j": job.pack()})
        pipe.execute()


def cancel_jobs(r: redis.Redis, keys: Keys, ids: list[str], ttl: int) -> None:
    """Flag each job cancelled (for a queued one) and publish it (for a running one)."""
    sharded = clustered(r)
    with r.pipeline(transaction=False) as pipe:
        for jid in ids:
            pipe.set(keys.cancel_flag(jid), 1, ex=max(1, ttl))
            publish(pipe, keys.cancel_channel, jid.encode(), sharded)
        pipe.execute()


def last_event(r: redis.Redis, keys: Keys, job_id: str) -> TokenEvent | None:
    last = r.xrevrange(keys.output_stream(job_id), count=1)
    return entry_events(last[0][1])[-1] if last else None


def _events(fields: dict) -> list[TokenEvent | None]:
    """An entry's events (one step may have written several), or [None] for an entry this
    version cannot read: skipped, its cursor passed."""
    try:
        return list(entry_events(fields))
    except SchemaError:
        return [None]


def read_outputs(
    r: redis.Redis, cursors: dict[str, str], block_ms: int
) -> list[tuple[str, list[tuple[str, TokenEvent | None]]]]:
    """New entries of output streams after their cursors: [(stream, [(entry id, event or
    None for an unreadable entry)])] (an entry of several events gives a pair for each).

    One XREAD BLOCK when the streams share a slot (always on a single server); on a Redis
    Cluster, where one command reaches one slot, a non-blocking XREAD per slot, and a short
    sleep when none had anything (the choices of one request have ids in different slots)."""
    groups: dict[int, dict[str, str]] = {}
    for stream, cursor in cursors.items():
        groups.setdefault(key_slot(stream.encode()) if clustered(r) else 0, {})[stream] = cursor
    if len(groups) <= 1:
        return _parsed(r.xread(cursors, count=1024, block=max(1, block_ms)))
    out = []
    for group in groups.values():
        out += _parsed(r.xread(group, count=1024))
    if not out:
        time.sleep(min(block_ms, 50) / 1000)
    return out


def _parsed(reply) -> list[tuple[str, list[tuple[str, TokenEvent | None]]]]:
    out = []
    for name, entries in reply or []:
        stream = name.decode() if isinstance(name, bytes) else name
        events = []
        for eid, fields in entries:
            entry_id = eid.decode() if isinstance(eid, bytes) else eid
            events += [(entry_id, ev) for ev in _events(fields)]
        out.append((stream, events))
    return out
