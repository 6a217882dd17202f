"""The batch worker: rq's forking worker that runs only the batch job (`ALLOWED_FUNCTIONS`: any
other job is failed with the reason, without being executed; a pickled job is never loaded),
with a shorter abandoned-job window: the started-job registry entry of a job whose worker died
expires `abandon_after` seconds after its last heartbeat (rq's own default is 60 s more than the
heartbeat), then rq's maintenance retries it."""

from __future__ import annotations

from typing import Any

from rq import Queue, Worker
from rq.exceptions import DeserializationError
from rq.job import Job
from rq.worker import WorkerStatus
from syshax.batch.jobs import SERIALIZER, run_request

ALLOWED_FUNCTIONS = frozenset({f"{run_request.__module__}.{run_request.__qualname__}"})


def refusal(job: Job) -> str | None:
    """Why a batch worker must not run `job`, or None. Loading the job's data is safe: JSON."""
    try:
        name = job.func_name
    except DeserializationError:
        return f"job {job.id} refused: its data is not JSON (pickled jobs are never loaded)"
    if name not in ALLOWED_FUNCTIONS:
        return (
            f"job {job.id} refused: function {name!r} is not a farm batch function "
            f"(allowed: {', '.join(sorted(ALLOWED_FUNCTIONS))})"
        )
    return None


class BatchWorker(Worker):
    """rq's forking worker, with JSON jobs and only the farm's own job functions (`refusal`); a
    dead worker's job is found abandoned `abandon_after` s after its last heartbeat (sent every
    `job_monitoring_interval` s) instead of rq's 60 s margin."""

    abandon_after: int = 15

    def __init__(self, *args: Any, **kw: Any) -> None:
        kw["serializer"] = SERIALIZER
        super().__init__(*args, **kw)

    def execute_job(self, job: Job, queue: Queue) -> None:
        reason = refusal(job)
        if reason is None:
            super().execute_job(job, queue)
            return
        # Failed at once, never retried, never forked or imported: the reason is the result.
        self.log.error("%s", reason)
        job.retries_left = 0
        execution = self.prepare_execution(job)
        self.handle_job_failure(job, queue, exc_string=reason, execution=execution)
        self.set_state(WorkerStatus.IDLE)

    def unsubscribe(self) -> None:
        """rq's, with the listener thread told to stop BEFORE rq sends UNSUBSCRIBE.

        rq sends UNSUBSCRIBE, then stops the thread. When the thread reads the reply before
        the stop, it finds nothing subscribed and waits up to 60 s (rq's sleep_time) for a
        new subscription, and redis-py >= 8 joins it without a timeout: a warm shutdown hung
        until the supervisor's second SIGTERM (20 s) in about 1 of 4 stops. With the run flag
        cleared first, the reply ends the thread's loop at once."""
        running = getattr(self.pubsub_thread, "_running", None)  # redis-py's flag (5.x-8.x)
        if running is not None:
            running.clear()
        super().unsubscribe()

    def get_heartbeat_ttl(self, job: Job, working_time: float = 0.0) -> int:
        interval = self.job_monitoring_interval
        if job.timeout and job.timeout > 0:
            interval = min(interval, max(1, int(job.timeout - working_time)))
        return int(interval) + self.abandon_after
