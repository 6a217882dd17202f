"""Push consumers on the RabbitMQ job queues (broker/amqp_push.py) against the machine's
RabbitMQ (skipped, saying why, where none answers) and a real Redis: a worker's own queues
push it at most `prefetch` jobs, the rest stay in the queue for the others; an idle read
returns on the job's arrival; a draining worker gives back the jobs pushed and not taken, and
a killed one has them redelivered."""

from __future__ import annotations

import threading
import time

import pytest
from syshax.broker.amqp_connection import queue_name
from syshax.broker.job_transport import WorkerJobs
from syshax.broker.keys import Keys

from ..amqp_server import amqp_prefix, queue_counts  # noqa: F401 - the fixture


@pytest.fixture
def keys(amqp_prefix: str) -> Keys:  # noqa: F811 - the imported fixture
    return Keys(amqp_prefix)


def _pushed(jobs: WorkerJobs, n: int) -> int:
    """Wait (10 s at most) until `n` jobs were pushed to this connection; how many were."""
    deadline = time.monotonic() + 10
    while jobs.amqp.push.buffered() < n and time.monotonic() < deadline:
        jobs.amqp.wait(0.05)
    return jobs.amqp.push.buffered()


def test_a_worker_is_pushed_at_most_its_prefetch_and_the_rest_wait_for_others(r, keys):
    worker = WorkerJobs(r, keys, "w1", "amqp")
    other = WorkerJobs(r, keys, "w2", "amqp")
    try:
        queues = worker.queues([keys.prefill_stream], prefetch=2)
        for i in range(5):
            other.amqp.publish(keys.prefill_stream, f"job-{i}".encode())
        assert _pushed(worker, 2) == 2
        worker.amqp.wait(0.2)  # nothing more comes: two unacked is its limit
        assert worker.amqp.push.buffered() == 2
        assert queue_counts(keys)[queue_name(keys.prefill_stream)] == 3
        taken = queues.read(4, None)
        assert [e.data for e in taken] == [b"job-0", b"job-1"]
        # The others take the rest by basic.get (a queue they do not consume).
        rest = other.queues([keys.prefill_stream]).read(4, None)
        assert [e.data for e in rest] == [b"job-2", b"job-3", b"job-4"]
        for e in taken:
            queues.ack(e)
        for e in rest:
            other.queues([keys.prefill_stream]).ack(e)
    finally:
        worker.close()
        other.close()
    assert queue_counts(keys)[queue_name(keys.prefill_stream)] == 0


def test_an_idle_read_returns_when_a_job_is_pushed(r, keys):
    worker = WorkerJobs(r, keys, "w1", "amqp")
    publisher = WorkerJobs(r, keys, "gw", "amqp")
    try:
        queues = worker.queues([keys.decode_stream("cpu")], prefetch=4)
        later = threading.Timer(0.3, publisher.amqp.publish, (keys.decode_stream("cpu"), b"late"))
        later.start()
        (entry,) = queues.read(1, 20_000)  # blocks on the connection, not a poll loop
        later.join()
        assert entry.data == b"late" and not entry.reclaimed
        queues.ack(entry)
    finally:
        worker.close()
        publisher.close()


def test_a_draining_worker_gives_back_what_was_pushed_and_a_killed_one_has_it_redelivered(r, keys):
    stream = keys.prefill_stream
    worker = WorkerJobs(r, keys, "w1", "amqp")
    try:
        worker.queues([stream], prefetch=3)
        for i in range(3):
            worker.amqp.publish(stream, f"p{i}".encode())
        assert _pushed(worker, 3) == 3
        worker.stop_pushes()
        assert worker.amqp.push.buffered() == 0
        assert queue_counts(keys)[queue_name(stream)] == 3  # back at once, not at its exit
    finally:
        worker.close()
    dying = WorkerJobs(r, keys, "w2", "amqp")
    dying.queues([stream], prefetch=3)
    assert _pushed(dying, 3) == 3
    dying.close()  # killed: its connection closes with the pushed jobs unacked
    survivor = WorkerJobs(r, keys, "w3", "amqp")
    try:
        queues = survivor.queues([stream], prefetch=3)
        assert _pushed(survivor, 3) == 3
        again = queues.read(3, None)
        assert sorted(e.data for e in again) == [b"p0", b"p1", b"p2"]
        assert all(e.reclaimed for e in again)  # redelivered: resumed, not started anew
        for e in again:
            queues.ack(e)
    finally:
        survivor.close()
    assert queue_counts(keys)[queue_name(stream)] == 0


def test_a_consumer_rabbitmq_cancels_makes_the_worker_reconnect(r, keys):
    """Its queue deleted under it: the next read raises AmqpUnreachable (a
    redis.ConnectionError: the worker's loop reconnects, which declares and consumes again)."""
    from syshax.broker.amqp_connection import AmqpUnreachable

    from ..amqp_server import connect

    worker = WorkerJobs(r, keys, "w1", "amqp")
    try:
        queues = worker.queues([keys.decode_stream("cpu")], prefetch=2)
        conn = connect()
        conn.channel().queue_delete(queue_name(keys.decode_stream("cpu")))
        conn.close()
        with pytest.raises(AmqpUnreachable, match="cancelled the consumer"):
            queues.read(1, 10_000)  # returns at the cancel, not after the 10 s
    finally:
        worker.close()
    again = WorkerJobs(r, keys, "w1", "amqp")  # a new connection declares the queue again
    try:
        queues = again.queues([keys.decode_stream("cpu")], prefetch=2)
        again.amqp.publish(keys.decode_stream("cpu"), b"after")
        (entry,) = queues.read(1, 10_000)
        assert entry.data == b"after"
        queues.ack(entry)
    finally:
        again.close()
