"""The job queues a worker reads, grouped by what it reads them for (workers/worker.py), on
the farm's job transport (`broker.jobs`: Redis streams or RabbitMQ queues)."""

from __future__ import annotations

from dataclasses import dataclass

import redis
from syshax.broker.job_transport import JobQueue, WorkerJobs
from syshax.broker.keys import DEVICE_CLASSES, Keys

from .worker_options import WorkerOptions


@dataclass
class Streams:
    # Its interactive streams (its class's decode stream, the prefill stream): read first.
    work: JobQueue
    # Batch prompts have their own stream, read only when the interactive ones gave nothing.
    batch: JobQueue | None
    # Every stream it serves: the blocking read while idle, and claims of dead workers' jobs.
    idle: JobQueue
    # The other class's decode stream (decoders only), read only while that class has no live
    # decoder (upkeep.py), or by a CPU worker taking a job from the full xPU's queue
    # (handoff.py): a job handed off while its class's decoders looked dead (a late
    # heartbeat, all of them killed) would otherwise wait there for nobody.
    stranded: JobQueue | None
    other_class: str
    jobs: WorkerJobs  # opens more views on the same transport (handoff.py's prefill-ahead)

    @classmethod
    def open(cls, r: redis.Redis, opts: WorkerOptions, keys: Keys, slots: int = 0) -> Streams:
        """The streams for `opts.roles`, their consumer groups created. `slots`: the sequences
        the worker holds at once; on RabbitMQ, its own queues push it at most that many jobs
        each, those it runs included (the other class's decode queue is read only on demand)."""
        jobs = WorkerJobs(r, keys, opts.worker_id, opts.jobs, opts.amqp_url)
        streams = []
        if "decode" in opts.roles:
            streams.append(keys.decode_stream(opts.device_class))
        if "prefill" in opts.roles:
            streams.append(keys.prefill_stream)
        work = jobs.queues(streams, prefetch=slots)
        work.ensure_groups()
        batch, idle = None, work
        if "prefill" in opts.roles:
            batch = jobs.queues([keys.prefill_batch_stream])
            batch.ensure_groups()
            idle = jobs.queues([*streams, keys.prefill_batch_stream])
        other_class = next(c for c in DEVICE_CLASSES if c != opts.device_class)
        stranded = None
        if "decode" in opts.roles:
            stranded = jobs.queues([keys.decode_stream(other_class)])
            stranded.ensure_groups()
        return cls(work, batch, idle, stranded, other_class, jobs)

    def close(self) -> None:
        """The transport's connection (RabbitMQ's; the Redis client is the worker's own)."""
        self.jobs.close()
