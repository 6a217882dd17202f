"""Batch jobs a worker dequeued but never started, put back in the queue.

An rq worker takes a job by moving its id from the queue to the queue's intermediate list
(one LMOVE), then marks it started (status, started-job registry, id out of the list) in a
second write. When Redis dies between the two, or the second lands in the last second its
append-only file had not yet synced, the restarted Redis holds the job in the intermediate
list with status "queued": no worker will dequeue it, and no started-job entry expires to
retry it. rq's own sweep of that list runs in a worker's maintenance, which a worker only
reaches between dequeues: one blocked on an empty queue waits up to its dequeue timeout
(~400 s) first, and then fails the job with a retry. Seen once in CI: one job of six still
"queued" 240 s after the embedded Redis was SIGKILLed (tests/reliability/test_run_farm.py).

The batch supervisor sweeps the list itself (`StrandedJobs.sweep`, from its maintenance
tick): an id that sits there, not started, in two sweeps at least `grace` seconds apart goes
back to the front of the queue, as it was (it never ran, so it costs no retry). A live
worker moves a job out of the list within milliseconds of taking it, so the grace only has
to outlast that; a job whose status is no longer "queued" is left to rq.
"""

from __future__ import annotations

import time

from rq import Queue
from rq.job import JobStatus

DEFAULT_GRACE = 20.0  # seconds an id must sit in the intermediate list before it is moved


class StrandedJobs:
    """The intermediate list's ids seen so far and when each was first seen."""

    def __init__(self, grace: float = DEFAULT_GRACE) -> None:
        self.grace = grace
        self.first_seen: dict[str, float] = {}

    def sweep(self, queue: Queue, now: float | None = None) -> list[str]:
        """Requeue the ids stranded at least `grace` seconds; returns them."""
        now = time.monotonic() if now is None else now
        listed = queue.intermediate_queue.get_job_ids()
        if not listed:
            self.first_seen = {}
            return []
        started = set(queue.started_job_registry.get_job_ids(cleanup=False))
        seen = {i: self.first_seen.get(i, now) for i in listed if i not in started}
        self.first_seen = seen
        moved = []
        for job_id, first in list(seen.items()):
            if now - first < self.grace:
                continue
            job = queue.fetch_job(job_id)
            if job is None:  # deleted (its batch cancelled and cleaned): nothing to run
                queue.intermediate_queue.remove(job_id)
            elif job.get_status(refresh=True) == JobStatus.QUEUED:
                queue.intermediate_queue.remove(job_id)
                if job_id not in queue.get_job_ids():
                    queue.enqueue_job(job, at_front=True)
                moved.append(job_id)
            del self.first_seen[job_id]
        return moved
