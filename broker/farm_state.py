"""A snapshot of a farm's state for people (`syshax top`), read from Redis."""

from __future__ import annotations

import redis

from .dead_letters import list_dead
from .keys import DEVICE_CLASSES, KEYS, Keys
from .kv_store import KVStore
from .worker_io import live_workers


def per_model(workers: list[dict]) -> dict[str, dict[str, int]]:
    """Served model -> its live workers, running + waiting sequences and decode capacity."""
    out: dict[str, dict[str, int]] = {}
    for w in workers:
        row = out.setdefault(w.get("model", ""), {"workers": 0, "load": 0, "capacity": 0})
        row["workers"] += 1
        row["load"] += int(w.get("running", 0)) + int(w.get("waiting", 0))
        if "decode" in w.get("roles", "").split(","):
            row["capacity"] += int(w.get("capacity", 0))
    return out


DEAD_SHOWN = 5  # dead letters `syshax top` lists (`syshax dead-letters list` shows them all)


def snapshot(r: redis.Redis, keys: Keys = KEYS, models: tuple[str, ...] = ("",)) -> dict:
    """Everything `syshax top` shows, read in a few round trips: live workers, each stream's
    waiting and taken entries, the last dispatcher decisions and their counts, KV leases, and
    how many dead letters there are with the newest `DEAD_SHOWN` (dead_letters.list_dead).
    `models`: the stream keys of the farm's models (config `models:`; "" = the one model's
    streams); a farm of several shows each model's streams under its name, and its capacity."""
    streams = {}
    for model in models:
        mk, name = keys.for_model(model), f"{model} " if model else ""
        streams[f"{name}prefill"] = mk.prefill_stream
        streams[f"{name}prefill:batch"] = mk.prefill_batch_stream
        streams.update({f"{name}decode:{c}": mk.decode_stream(c) for c in DEVICE_CLASSES})
    pipe = r.pipeline(transaction=False)  # the farm's keys and counters: read, not changed
    for s in streams.values():
        pipe.xlen(s)
        pipe.xpending(s, keys.decode_group)
    pipe.lrange(keys.dispatch_log, 0, 9)
    for c in DEVICE_CLASSES:
        pipe.get(keys.dispatch_count(c))
    pipe.xlen(keys.dead_letter_stream)
    replies = pipe.execute(raise_on_error=False)
    queues = {}
    for i, name in enumerate(streams):
        length, pending = replies[2 * i], replies[2 * i + 1]
        taken = pending.get("pending", 0) if isinstance(pending, dict) else 0
        length = length if isinstance(length, int) else 0
        queues[name] = (max(length - taken, 0), taken)
    rest = replies[2 * len(streams) :]
    decisions = [d.decode() if isinstance(d, bytes) else d for d in rest[0]]
    counts = {
        c: int(v or 0)
        for c, v in zip(DEVICE_CLASSES, rest[1 : 1 + len(DEVICE_CLASSES)], strict=True)
    }
    dead_count = rest[-1] if isinstance(rest[-1], int) else 0
    leases, nbytes = KVStore(r, keys).stats()
    workers = sorted(
        live_workers(r, keys),
        key=lambda w: (w.get("model", ""), w.get("device_class", ""), w.get("id", "")),
    )
    return {
        "workers": workers,
        "models": per_model(workers) if models != ("",) else {},
        "queues": queues,
        "decisions": decisions,
        "counts": counts,
        "kv": (leases, nbytes),
        "dead_letters": {
            "count": dead_count,
            "newest": list_dead(r, keys, DEAD_SHOWN) if dead_count else [],
        },
    }
