"""A snapshot of a farm's state for people (`syshax top`), read from Redis."""

from __future__ import annotations

from typing import TYPE_CHECKING

import redis

from .dead_letters import list_dead
from .keys import KEYS, Keys
from .kv_store import KVStore
from .model_state import dispatch_counts, job_streams, model_rows, total_counts
from .worker_io import live_workers

if TYPE_CHECKING:
    from .amqp_view import AmqpQueueView  # pika only where the farm's jobs are on RabbitMQ

DEAD_SHOWN = 5  # dead letters `syshax top` lists (`syshax dead-letters list` shows them all)


def snapshot(
    r: redis.Redis,
    keys: Keys = KEYS,
    models: tuple[str, ...] = ("",),
    amqp: AmqpQueueView | None = None,
) -> dict:
    """Everything `syshax top` shows, read in a few round trips: live workers, each stream's
    waiting and taken entries, the last dispatcher decisions and their counts, KV leases, and
    how many dead letters there are with the newest `DEAD_SHOWN` (dead_letters.list_dead).
    `models`: the stream keys of the farm's models (config `models:`; "" = the one model's
    streams); a farm of several shows each model's streams under its name, and a row per
    model: its workers, sequences and capacity per device class, jobs waiting, decisions.
    `amqp`: the farm's RabbitMQ queues (`broker.jobs: amqp`): the prefill and decode queues'
    ready jobs (taken ones unknown: None) and the dead-letter queue's count (`rabbitmq_dead`)."""
    streams = job_streams(keys, models)
    pipe = r.pipeline(transaction=False)  # the farm's keys and counters: read, not changed
    for _, s in streams.values():
        pipe.xlen(s)
        pipe.xpending(s, keys.decode_group)
    pipe.lrange(keys.dispatch_log, 0, 9)
    pipe.xlen(keys.dead_letter_stream)
    replies = pipe.execute(raise_on_error=False)
    queues, jobs_waiting = {}, dict.fromkeys(models, 0)
    for i, (name, (model, _)) in enumerate(streams.items()):
        length, pending = replies[2 * i], replies[2 * i + 1]
        taken = pending.get("pending", 0) if isinstance(pending, dict) else 0
        length = length if isinstance(length, int) else 0
        queues[name] = (max(length - taken, 0), taken)
        stream = streams[name][1]
        if amqp is not None and stream != keys.for_model(model).prefill_batch_stream:
            queues[name] = (amqp.depth(stream), None)  # a RabbitMQ queue: its ready jobs
        jobs_waiting[model] += queues[name][0]
    rest = replies[2 * len(streams) :]
    decisions = [d.decode() if isinstance(d, bytes) else d for d in rest[0]]
    dead_count = rest[1] if isinstance(rest[1], int) else 0
    counts = dispatch_counts(r, keys, models)
    leases, nbytes = KVStore(r, keys).stats()
    workers = sorted(
        live_workers(r, keys),
        key=lambda w: (w.get("model", ""), w.get("device_class", ""), w.get("id", "")),
    )
    return {
        "workers": workers,
        # a farm of several models: each one's row (model_state.model_rows)
        "models": model_rows(models, workers, counts, jobs_waiting) if models != ("",) else {},
        "queues": queues,
        "decisions": decisions,
        "counts": total_counts(counts),
        "kv": (leases, nbytes),
        "dead_letters": {
            "count": dead_count,
            "newest": list_dead(r, keys, DEAD_SHOWN) if dead_count else [],
        },
        "rabbitmq_dead": amqp.dead_letters() if amqp is not None else None,
    }
