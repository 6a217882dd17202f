"""The worker's poll for new jobs, sent while the engine steps instead of between two steps.

While streams decode, the worker reads its interactive streams (one non-blocking XREADGROUP)
before every step. That round trip sat between one token's publish and the next step's start:
on a small host, where Redis, the gateway and the client share the cores with the kernels'
threads, it usually takes 0.1-0.5 ms but now and then waits several ms for a core, and the
stream's next token waits with it (docs/benchmarks.md, "The worker loop at one stream"). Here
the read is sent on a thread of its own right before the step (the native step releases the
GIL) and its entries are taken at the next schedule, exactly where the read used to be made.

What changes: an entry that arrives during a step is read one step later than before (its
request starts at most one step later); an entry read during a step waits for that step's end
in this worker's pending list, as it waited in the stream before. Redis streams only: the
RabbitMQ transport's connection is not shared between threads.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from syshax.broker.job_transport import JobQueue
from syshax.broker.worker_io import Entry


def _read_first(queues: list[JobQueue], count: int) -> list[Entry]:
    """The entries of the first of `queues` that has any (the worker's priority order)."""
    for queue in queues:
        entries = queue.read(count, None)
        if entries:
            return entries
    return []


class JobPrefetch:
    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="job-read")
        self._pending: Future[list[Entry]] | None = None

    @property
    def in_flight(self) -> bool:
        return self._pending is not None

    def start(self, count: int, queues: list[JobQueue]) -> None:
        """Send non-blocking reads of up to `count` entries, of `queues` in turn until one has
        any (none while a read is in flight)."""
        if self._pending is None and count > 0:
            self._pending = self._pool.submit(_read_first, queues, count)

    def collect(self) -> list[Entry] | None:
        """The entries of the read in flight (waiting for its answer), or None with none sent.
        The read's exception, if it raised, is raised here, where a direct read raises."""
        pending, self._pending = self._pending, None
        return None if pending is None else pending.result()

    def close(self) -> list[Entry]:
        """Stop; the entries of a read still in flight (the caller puts them back)."""
        try:
            return self.collect() or []
        finally:
            self._pool.shutdown(wait=True)

    def give_back(self, queue: JobQueue) -> None:
        """Stop (a draining worker); the entries of a read still in flight, never started
        here, go back to the end of their streams for another worker."""
        for entry in self.close():
            (queue.requeue if entry.data else queue.ack)(entry)
