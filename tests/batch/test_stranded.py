"""A batch job that a worker took from the queue but never started (Redis died between rq's two
writes) goes back to the queue after the grace, once, at the front; a started one, or one
within the grace, stays where it is. Real Redis; rq's own dequeue makes the state."""

from __future__ import annotations

from rq import Queue
from rq.job import JobStatus
from syshax.batch import batches
from syshax.batch.lines import parse_lines
from syshax.batch.stranded import StrandedJobs

from .test_jobs import BatchWorkers, _lines, _wait, echo_farm


def _take(queue: Queue):
    """What an rq worker does first: the job's id moved to the intermediate list (no start)."""
    job, _ = Queue.dequeue_any(
        [queue], None, connection=queue.connection, serializer=queue.serializer
    )
    return job


def test_a_job_taken_but_never_started_is_requeued_after_the_grace(r):
    queue = batches.batch_queue(r)
    stranded_job = queue.enqueue("os.getcwd")
    other = queue.enqueue("os.getcwd")
    assert _take(queue).id == stranded_job.id
    assert queue.intermediate_queue.get_job_ids() == [stranded_job.id]
    assert queue.get_job_ids() == [other.id]

    sweeper = StrandedJobs(grace=20)
    assert sweeper.sweep(queue, now=100.0) == []  # first seen
    assert sweeper.sweep(queue, now=119.0) == []  # within the grace: a live worker may start it
    assert sweeper.sweep(queue, now=120.5) == [stranded_job.id]
    assert queue.intermediate_queue.get_job_ids() == []
    assert queue.get_job_ids() == [stranded_job.id, other.id]  # back at the front, once
    assert stranded_job.get_status(refresh=True) == JobStatus.QUEUED
    assert sweeper.sweep(queue, now=200.0) == []
    assert queue.get_job_ids() == [stranded_job.id, other.id]


def test_a_started_job_and_a_deleted_one_are_not_requeued(r):
    queue = batches.batch_queue(r)
    started = queue.enqueue("os.getcwd")
    deleted = queue.enqueue("os.getcwd")
    assert _take(queue).id == started.id
    assert _take(queue).id == deleted.id
    started.set_status(JobStatus.STARTED)  # as a worker that got as far as its second write
    deleted.delete()
    sweeper = StrandedJobs(grace=20)
    sweeper.sweep(queue, now=0.0)
    assert sweeper.sweep(queue, now=30.0) == []
    assert queue.get_job_ids() == []
    # the started one is left to rq (its registries); the deleted one's id is dropped
    assert queue.intermediate_queue.get_job_ids() == [started.id]


def test_an_id_that_leaves_the_list_starts_its_grace_again(r):
    queue = batches.batch_queue(r)
    job = queue.enqueue("os.getcwd")
    _take(queue)
    sweeper = StrandedJobs(grace=20)
    sweeper.sweep(queue, now=0.0)
    queue.intermediate_queue.remove(job.id)  # the worker started it after all
    assert sweeper.sweep(queue, now=10.0) == []
    assert sweeper.first_seen == {}


def test_the_batch_worker_runs_a_job_left_taken_by_a_dead_redis(r, config, thread_farm):
    """The state a Redis restart can leave (one job moved to the intermediate list, status
    queued) before `syshax batch worker` starts: its sweep puts the job back and the batch
    completes, every result once."""
    with echo_farm(thread_farm):
        bid = batches.submit(r, parse_lines(_lines(3)))
        queue = batches.batch_queue(r)
        taken = _take(queue)
        with BatchWorkers(config, 1, extra=("--stranded-grace", "1")):
            st = _wait(r, bid, timeout=60)
    assert st["finished"] == 3, st
    assert queue.intermediate_queue.get_job_ids() == []
    results = list(batches.results(r, bid))
    assert [x["custom_id"] for _, _, x in results] == ["req-0", "req-1", "req-2"]
    assert taken.get_status(refresh=True) == JobStatus.FINISHED
