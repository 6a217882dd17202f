"""A snapshot of a farm's state for people (`syshax top`), read from Redis."""

from __future__ import annotations

import redis

from .keys import DEVICE_CLASSES, KEYS, Keys
from .kv_store import KVStore
from .worker_io import live_workers


def snapshot(r: redis.Redis, keys: Keys = KEYS) -> dict:
    """Everything `syshax top` shows, read in a few round trips: live workers, each stream's
    waiting and taken entries, the last dispatcher decisions and their counts, KV leases."""

    streams = {"prefill": keys.prefill_stream, "prefill:batch": keys.prefill_batch_stream}
    streams.update({f"decode:{c}": keys.decode_stream(c) for c in DEVICE_CLASSES})
    pipe = r.pipeline(transaction=False)  # the farm's keys and counters: read, not changed
    for s in streams.values():
        pipe.xlen(s)
        pipe.xpending(s, keys.decode_group)
    pipe.lrange(keys.dispatch_log, 0, 9)
    for c in DEVICE_CLASSES:
        pipe.get(keys.dispatch_count(c))
    replies = pipe.execute(raise_on_error=False)
    queues = {}
    for i, name in enumerate(streams):
        length, pending = replies[2 * i], replies[2 * i + 1]
        taken = pending.get("pending", 0) if isinstance(pending, dict) else 0
        length = length if isinstance(length, int) else 0
        queues[name] = (max(length - taken, 0), taken)
    rest = replies[2 * len(streams) :]
    decisions = [d.decode() if isinstance(d, bytes) else d for d in rest[0]]
    counts = {c: int(v or 0) for c, v in zip(DEVICE_CLASSES, rest[1:], strict=True)}
    leases, nbytes = KVStore(r, keys).stats()
    return {
        "workers": sorted(
            live_workers(r, keys), key=lambda w: (w.get("device_class", ""), w.get("id", ""))
        ),
        "queues": queues,
        "decisions": decisions,
        "counts": counts,
        "kv": (leases, nbytes),
    }
