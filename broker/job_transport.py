"""The seam between the farm and where its job queues live (`broker.jobs`).

`JobQueue` is what a worker does with a set of job queues: Redis streams (worker_io.WorkQueues,
today's code) or RabbitMQ quorum queues (amqp_jobs.AmqpQueues). `WorkerJobs` opens them for
one worker; `AsyncJobs` is the gateway's side (submitting prefill jobs).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from typing import TYPE_CHECKING, Any, Protocol

import redis

from .keys import DEVICE_CLASSES, Keys
from .schemas import RequestPart
from .worker_io import CLAIM_MIN_IDLE_MS, Claim, Entry, WorkQueues

if TYPE_CHECKING:
    from .dead_letters import DeadLetter

TRANSPORTS = ("redis", "amqp")


class JobQueue(Protocol):
    """Some job queues one worker consumes (the Redis streams' names for both transports)."""

    streams: list[str]
    consumer: str
    keys: Keys

    def ensure_groups(self) -> None: ...
    def read(self, count: int, block_ms: int | None) -> list[Entry]: ...
    def own_pending(self, count: int = 1000) -> list[Entry]: ...
    def lost_own(
        self, known: set[tuple[str, str]], min_idle_ms: int = CLAIM_MIN_IDLE_MS
    ) -> list[Entry]: ...
    def unread(self) -> int: ...
    def claim_orphans(self, live_consumers: set[str], count: int) -> Claim: ...
    def ack(self, entry: Entry) -> None: ...
    def hand_over(self, entry: Entry, stream: str, data: bytes) -> None: ...
    def requeue(self, entry: Entry) -> None: ...
    def dead_letter(self, entry: Entry, reason: str) -> None: ...

    def hand_over_choice(
        self,
        stream: str,
        data: bytes,
        *,
        request_id: str,
        choice: int,
        ttl: int,
        part: RequestPart | None,
        last: Entry | None,
    ) -> None: ...


class DeadLetterStore(Protocol):
    """Where a transport keeps the jobs workers set aside (`syshax dead-letters`): the Redis
    dead-letter stream (dead_letters.RedisDeadLetters) or RabbitMQ's dead-letter queue
    (amqp_dead_letters.AmqpDeadLetters). Raise dead_letters.DeadLetterError for no such
    letter or one that cannot be requeued."""

    where: str  # in words, for messages

    def list(self, count: int = 50) -> list[DeadLetter]: ...
    def get(self, letter_id: str) -> DeadLetter: ...
    def requeue(self, letter_id: str, who: str = "") -> DeadLetter: ...
    def drop(self, letter_id: str, who: str = "") -> DeadLetter: ...
    def close(self) -> None: ...


def open_dead_letters(
    r: redis.Redis,
    keys: Keys,
    jobs: str = "redis",
    amqp_url: str = "",
    models: tuple[str, ...] = ("",),
) -> DeadLetterStore:
    """The dead letters of a farm on its transport (`broker.jobs`); `models`: the stream keys
    of its models (RabbitMQ's letters name only their queue)."""
    if jobs not in TRANSPORTS:
        raise ValueError(f"broker.jobs must be one of {TRANSPORTS}, got {jobs!r}")
    if jobs == "amqp":
        from .amqp_dead_letters import AmqpDeadLetters

        return AmqpDeadLetters(r, keys, amqp_url, models)
    from .dead_letters import RedisDeadLetters

    return RedisDeadLetters(r, keys)


class WorkerJobs:
    """Opens a worker's job queues on its transport; one RabbitMQ connection for all of them
    (a delivery is acked on the channel that delivered it, whichever view read it)."""

    def __init__(
        self, r: redis.Redis, keys: Keys, consumer: str, jobs: str = "redis", amqp_url: str = ""
    ):
        if jobs not in TRANSPORTS:
            raise ValueError(f"broker.jobs must be one of {TRANSPORTS}, got {jobs!r}")
        self.r, self.keys, self.consumer, self.jobs = r, keys, consumer, jobs
        self.amqp = None
        if jobs == "amqp":
            from .amqp_connection import AmqpConnection

            self.amqp = AmqpConnection(amqp_url or None, keys)

    def queues(self, streams: list[str], prefetch: int = 0) -> JobQueue:
        """The queues of `streams`: on RabbitMQ those that are job queues there (every job
        stream but the batch one), the rest on Redis. `prefetch` > 0: RabbitMQ pushes their
        jobs to this connection, at most that many unacked per queue (amqp_push.py: the
        queues a worker serves); 0: they are read with basic.get (a queue read now and then)."""
        if self.amqp is None:
            return WorkQueues(self.r, streams, self.consumer, self.keys)
        from .amqp_connection import job_streams
        from .amqp_jobs import AmqpQueues

        on_amqp = [s for s in streams if s in job_streams(self.keys)]
        if prefetch > 0:
            for stream in on_amqp:
                self.amqp.consume(stream, prefetch)
        rest = WorkQueues(
            self.r, [s for s in streams if s not in on_amqp], self.consumer, self.keys
        )
        return AmqpQueues(self.amqp, self.r, on_amqp, self.consumer, rest)

    def add_queued(self, loads: dict, workers: list[dict[str, str]]) -> None:
        """The jobs waiting on RabbitMQ into `loads` (worker_io.device_loads counts those of the
        Redis streams, empty in amqp mode): ready in each queue, and pushed to this worker and
        not taken yet (a job taken is in its worker's heartbeat; those pushed to another worker
        are not seen, at most its prefetch less what it runs). A waiting prompt takes a slot of
        the class that prefills it."""
        if self.amqp is None:
            return
        amqp, keys = self.amqp, self.keys

        def waiting(stream: str) -> int:
            return amqp.depth(stream) + len(amqp.push.buffers.get(stream, ()))

        for cls, load in loads.items():
            load.queued += waiting(keys.decode_stream(cls))
        roles = {w.get("device_class") for w in workers if "prefill" in w.get("roles", "").split(",")}  # fmt: skip
        prefill_class = next((c for c in DEVICE_CLASSES if c in roles), None)
        if prefill_class in loads:
            loads[prefill_class].queued += waiting(keys.prefill_stream)

    def stop_pushes(self) -> None:
        """A draining worker: RabbitMQ pushes it no more jobs, and those pushed and not taken
        go back to their queues at once (not when it exits)."""
        if self.amqp is not None:
            self.amqp.stop_consuming()

    def close(self) -> None:
        if self.amqp is not None:
            self.amqp.close()


class JobPublisher:
    """Publishes jobs to RabbitMQ from synchronous code (the batch client; the gateway through
    AsyncJobs): one connection per process and farm key set, made on first use (rq's horses
    are forked: a child never writes on its parent's socket), each job confirmed before
    `publish` returns. A connection found closed is made anew before a job goes out on it; a
    publish is never retried (one whose confirm was lost may be queued already)."""

    def __init__(self, amqp_url: str = ""):
        self.url = amqp_url or None
        self._conns: dict[tuple[int, str], Any] = {}
        self._lock = threading.Lock()

    def _connection(self, keys: Keys):
        from .amqp_connection import AmqpConnection

        key = (os.getpid(), keys.prefill_stream)
        conn = self._conns.get(key)
        if conn is not None:
            try:
                conn.conn.process_data_events(0)  # heartbeats; raises when it is closed
            except Exception:  # noqa: BLE001 - any failure: a new connection
                conn.close()
                conn = None
        if conn is None:
            conn = AmqpConnection(self.url, keys)  # AmqpUnreachable: the caller's 503
            self._conns[key] = conn
        return conn

    def publish(self, keys: Keys, stream: str, data: bytes) -> None:
        from .amqp_connection import AmqpUnreachable

        with self._lock:
            conn = self._connection(keys)
            try:
                conn.publish(stream, data)
            except AmqpUnreachable:
                conn.close()
                self._conns.pop((os.getpid(), keys.prefill_stream), None)
                raise

    def depth(self, keys: Keys, stream: str) -> int:
        with self._lock:
            return self._connection(keys).depth(stream)

    def close(self) -> None:
        with self._lock:
            for (pid, _), conn in list(self._conns.items()):
                if pid == os.getpid():
                    conn.close()
            self._conns.clear()


class AsyncJobs:
    """The gateway's RabbitMQ publisher: a JobPublisher in one thread of its own (the event
    loop never waits on a socket; the connection is only ever used by that thread)."""

    def __init__(self, keys: Keys, amqp_url: str = ""):
        self.keys = keys
        self.sync = JobPublisher(amqp_url)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="amqp-jobs")

    async def submit(self, stream: str, data: bytes) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._pool, self.sync.publish, self.keys, stream, data)

    async def depth(self, stream: str) -> int:
        """Jobs waiting in a queue (the gateway's admission limit reads the prefill queue's)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self.sync.depth, self.keys, stream)

    async def aclose(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self._pool, self.sync.close)
        self._pool.shutdown(wait=False)
