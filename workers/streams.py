"""The streams a worker reads, grouped by what it reads them for (workers/worker.py)."""

from __future__ import annotations

from dataclasses import dataclass

import redis
from syshax.broker.keys import DEVICE_CLASSES, Keys
from syshax.broker.worker_io import WorkQueues

from .worker_options import WorkerOptions


@dataclass
class Streams:
    # Its interactive streams (its class's decode stream, the prefill stream): read first.
    work: WorkQueues
    # Batch prompts have their own stream, read only when the interactive ones gave nothing.
    batch: WorkQueues | None
    # Every stream it serves: the blocking read while idle, and claims of dead workers' jobs.
    idle: WorkQueues
    # The other class's decode stream (decoders only), read only while that class has no live
    # decoder (upkeep.py), or by a CPU worker taking a job from the full xPU's queue
    # (handoff.py): a job handed off while its class's decoders looked dead (a late
    # heartbeat, all of them killed) would otherwise wait there for nobody.
    stranded: WorkQueues | None
    other_class: str

    @classmethod
    def open(cls, r: redis.Redis, opts: WorkerOptions, keys: Keys) -> Streams:
        """The streams for `opts.roles`, their consumer groups created."""
        wid = opts.worker_id
        streams = []
        if "decode" in opts.roles:
            streams.append(keys.decode_stream(opts.device_class))
        if "prefill" in opts.roles:
            streams.append(keys.prefill_stream)
        work = WorkQueues(r, streams, wid, keys)
        work.ensure_groups()
        batch, idle = None, work
        if "prefill" in opts.roles:
            batch = WorkQueues(r, [keys.prefill_batch_stream], wid, keys)
            batch.ensure_groups()
            idle = WorkQueues(r, [*streams, keys.prefill_batch_stream], wid, keys)
        other_class = next(c for c in DEVICE_CLASSES if c != opts.device_class)
        stranded = None
        if "decode" in opts.roles:
            stranded = WorkQueues(r, [keys.decode_stream(other_class)], wid, keys)
            stranded.ensure_groups()
        return cls(work, batch, idle, stranded, other_class)
