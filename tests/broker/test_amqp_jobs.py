"""The job queues on RabbitMQ (broker/amqp_jobs.py) against the machine's real RabbitMQ and a
real Redis: quorum queues with a delivery limit and a dead-letter exchange, redelivery of a
dead worker's jobs, and the handoff's order (confirmed decode job, mark, ack) with duplicates
dropped by job id, so a crash at any point loses and repeats nothing."""

from __future__ import annotations

import pytest
from syshax.broker import choices
from syshax.broker.amqp_connection import (
    DELIVERY_LIMIT,
    AmqpEntry,
    dead_letter_exchange,
    queue_name,
)
from syshax.broker.amqp_jobs import AmqpQueues
from syshax.broker.job_transport import WorkerJobs
from syshax.broker.keys import Keys
from syshax.broker.schemas import DecodeJob

from ..amqp_server import amqp_prefix, connect, queue_counts  # noqa: F401 - the fixture

CPU = "cpu"


@pytest.fixture
def keys(amqp_prefix: str) -> Keys:  # noqa: F811 - the imported fixture
    return Keys(amqp_prefix)


def decode_job(rid: str = "r1") -> bytes:
    return DecodeJob(request_id=rid, prompt_ids=[1, 2], output_ids=[3], params={}).pack()


def open_worker(r, keys: Keys, name: str = "w1") -> WorkerJobs:
    return WorkerJobs(r, keys, name, "amqp")


def test_queues_are_quorum_queues_with_a_delivery_limit(r, keys) -> None:
    """Declaring a job queue with one argument changed is refused (PRECONDITION_FAILED naming
    it): they are quorum queues with our delivery limit and dead-letter exchange."""
    import pika.exceptions

    open_worker(r, keys).close()
    ours = {
        "x-queue-type": "quorum",
        "x-delivery-limit": DELIVERY_LIMIT,
        "x-dead-letter-exchange": dead_letter_exchange(keys),
    }
    for arg, other in (("x-queue-type", "classic"), ("x-delivery-limit", DELIVERY_LIMIT + 1)):
        conn = connect()
        with pytest.raises(pika.exceptions.ChannelClosedByBroker, match=arg):
            conn.channel().queue_declare(
                queue_name(keys.decode_stream(CPU)), durable=True, arguments={**ours, arg: other}
            )
        conn.close()
    conn = connect()  # the same arguments are accepted: they are the queue's
    conn.channel().queue_declare(queue_name(keys.decode_stream(CPU)), durable=True, arguments=ours)
    conn.close()


def test_a_dead_workers_jobs_are_redelivered_as_reclaimed(r, keys) -> None:
    jobs = open_worker(r, keys)
    jobs.amqp.publish(keys.prefill_stream, b"job-1")
    taken = jobs.queues([keys.prefill_stream]).read(4, 500)
    assert [e.data for e in taken] == [b"job-1"] and not taken[0].reclaimed
    jobs.close()  # a killed worker: its connection closes with the job unacked
    other = open_worker(r, keys, "w2")
    again = other.queues([keys.prefill_stream]).read(4, 2000)
    assert [e.data for e in again] == [b"job-1"] and again[0].reclaimed
    other.queues([keys.prefill_stream]).ack(again[0])
    other.close()
    assert queue_counts(keys)[queue_name(keys.prefill_stream)] == 0


def test_handoff_publishes_marks_then_acks(r, keys) -> None:
    jobs = open_worker(r, keys)
    prefill = jobs.queues([keys.prefill_stream])
    decode = jobs.queues([keys.decode_stream(CPU)])
    jobs.amqp.publish(keys.prefill_stream, b"prompt")
    (entry,) = prefill.read(1, 500)
    prefill.hand_over(entry, keys.decode_stream(CPU), decode_job("r1"))
    assert r.smembers(keys.handed_off("r1")) == {b"0"}
    (job,) = decode.read(4, 500)
    assert DecodeJob.unpack(job.data).request_id == "r1"
    decode.ack(job)
    jobs.close()
    counts = queue_counts(keys)
    assert counts[queue_name(keys.prefill_stream)] == 0  # acked: not redelivered on close
    assert counts[queue_name(keys.decode_stream(CPU))] == 0


def test_a_crash_after_the_mark_is_not_handed_off_twice(r, keys) -> None:
    """The prefill job's worker died after the mark and before the ack: its job comes back,
    and the intake's open_choices sees its one choice handed off."""
    jobs = open_worker(r, keys)
    jobs.amqp.publish(keys.prefill_stream, b"prompt")
    (entry,) = jobs.queues([keys.prefill_stream]).read(1, 500)
    queues = jobs.queues([keys.prefill_stream])
    queues.amqp.publish(keys.decode_stream(CPU), decode_job("r2"))
    r.sadd(keys.handed_off("r2"), 0)  # the mark; then the process dies before its ack
    jobs.close()
    other = open_worker(r, keys, "w2")
    (back,) = other.queues([keys.prefill_stream]).read(1, 2000)
    assert back.reclaimed
    _, handed = choices.open_choices(r, keys, "r2", ["r2"], back.reclaimed)
    assert handed == {0}
    _, fresh = choices.open_choices(r, keys, "r3", ["r3"], False)
    assert fresh == set()
    other.close()


def test_a_duplicate_decode_job_is_dropped_by_job_id(r, keys) -> None:
    """A handoff that died between its confirm and its mark is redone by whoever takes the
    prefill job over: two decode jobs of one request. The first taken owns the request; the
    other is dropped unread; the owner's own redelivery still runs."""
    from syshax.broker.kv_store import KVStore

    jobs = open_worker(r, keys)
    stream = keys.decode_stream(CPU)
    kv = KVStore(r, keys)
    leases = [kv.put(b"k" * 100, {}, "r4", store="redis") for _ in range(2)]
    for lease in leases:  # the first handoff's job, then the redone handoff's copy
        job = DecodeJob(request_id="r4", prompt_ids=[1, 2], output_ids=[3], params={}, kv=lease)
        jobs.amqp.publish(stream, job.pack())
    decode = jobs.queues([stream])
    taken = decode.read(4, 500)
    assert len(taken) == 1
    assert queue_counts(keys)[queue_name(stream)] == 0  # the copy was acked, not left
    assert kv.stats()[0] == 1  # the copy's lease freed with it; the owner's kept
    assert DecodeJob.unpack(taken[0].data).kv.handle_id == leases[0].handle_id
    jobs.close()  # the decoder dies holding the owner
    other = open_worker(r, keys, "w2")
    again = other.queues([stream]).read(4, 2000)
    assert len(again) == 1 and again[0].reclaimed
    assert isinstance(again[0], AmqpEntry) and again[0].message_id == taken[0].message_id
    other.queues([stream]).ack(again[0])
    other.close()


def test_requeue_keeps_the_owner(r, keys) -> None:
    """A draining worker puts its decode job back: the job (same message id) still owns its
    request, so the next worker runs it."""
    jobs = open_worker(r, keys)
    stream = keys.decode_stream(CPU)
    jobs.amqp.publish(stream, decode_job("r5"))
    decode = jobs.queues([stream])
    (job,) = decode.read(1, 500)
    decode.requeue(job)
    (again,) = decode.read(1, 500)
    assert again.message_id == job.message_id and again.data == job.data
    decode.ack(again)
    jobs.close()


def test_poison_jobs_go_to_the_dead_letter_exchange(r, keys) -> None:
    jobs = open_worker(r, keys)
    queues: AmqpQueues = jobs.queues([keys.prefill_stream])
    jobs.amqp.publish(keys.prefill_stream, b"garbage")
    (entry,) = queues.read(1, 500)
    queues.dead_letter(entry, "undecodable job")
    jobs.close()
    assert queue_counts(keys)[dead_letter_exchange(keys)] == 1


def test_a_job_returned_past_the_delivery_limit_is_dead_lettered(r, keys) -> None:
    """RabbitMQ itself counts the returns (a job that kills every worker taking it)."""
    jobs = open_worker(r, keys)
    jobs.amqp.publish(keys.prefill_stream, b"kills its worker")
    ch = jobs.amqp.channel
    returns = 0
    while returns <= DELIVERY_LIMIT + 1:
        method, _, _ = ch.basic_get(queue_name(keys.prefill_stream))
        if method is None:
            break
        ch.basic_nack(method.delivery_tag, requeue=True)
        returns += 1
    jobs.close()
    counts = queue_counts(keys)
    assert counts[queue_name(keys.prefill_stream)] == 0
    assert counts[dead_letter_exchange(keys)] == 1
    # Taken DELIVERY_LIMIT + 1 times on RabbitMQ 3.x (dead-lettered when its count passes the
    # limit); a server counting the first delivery too stops one earlier.
    assert DELIVERY_LIMIT <= returns <= DELIVERY_LIMIT + 1


def test_batch_entries_stay_on_redis(r, keys) -> None:
    """The batch stream is not a RabbitMQ queue: its entries are read, acked and requeued on
    Redis through the same view."""
    jobs = open_worker(r, keys)
    idle = jobs.queues([keys.prefill_stream, keys.prefill_batch_stream])
    idle.ensure_groups()
    r.xadd(keys.prefill_batch_stream, {"j": b"batch"})
    (entry,) = idle.read(2, 500)
    assert not isinstance(entry, AmqpEntry) and entry.data == b"batch"
    idle.ack(entry)
    assert r.xlen(keys.prefill_batch_stream) == 0
    jobs.close()


def test_jobs_waiting_on_rabbitmq_count_in_the_dispatchers_loads(r, keys) -> None:
    """device_loads counts the Redis streams (empty in amqp mode); the queues' waiting jobs are
    added: decode jobs to their class, prompts to the class that prefills them."""
    from syshax.broker.dispatcher import DeviceLoad

    jobs = open_worker(r, keys)
    for rid in ("a", "b"):
        jobs.amqp.publish(keys.decode_stream(CPU), decode_job(rid))
    jobs.amqp.publish(keys.prefill_stream, b"prompt")
    loads = {"xpu": DeviceLoad(), "cpu": DeviceLoad()}
    jobs.add_queued(loads, [{"device_class": "xpu", "roles": "prefill"}])
    assert (loads["xpu"].queued, loads["cpu"].queued) == (1, 2)
    jobs.close()


def test_the_gateways_publisher_reconnects_before_publishing(r, keys) -> None:
    """A connection found closed (RabbitMQ restarted, heartbeats missed) is made anew before a
    job goes out on it, so no job is published twice."""
    import asyncio

    from syshax.broker.job_transport import AsyncJobs

    async def run() -> int:
        jobs = AsyncJobs(keys, "")
        await jobs.submit(keys.prefill_stream, b"one")
        for conn in jobs.sync._conns.values():
            conn.conn.close()  # gone under the publisher
        await jobs.submit(keys.prefill_stream, b"two")
        depth = await jobs.depth(keys.prefill_stream)
        await jobs.aclose()
        return depth

    assert asyncio.run(run()) == 2


def test_a_lost_connection_is_the_workers_redis_outage_path(r, keys) -> None:
    """RabbitMQ going away raises what workers/process.py already recovers from (a
    redis.ConnectionError: abort the engine's sequences, reconnect with a backoff), and the
    jobs the lost connection held are redelivered to whoever connects."""
    import redis as redis_lib
    from syshax.broker.amqp_connection import AmqpUnreachable

    jobs = open_worker(r, keys)
    jobs.amqp.publish(keys.prefill_stream, b"held")
    queues = jobs.queues([keys.prefill_stream])
    (held,) = queues.read(1, 500)
    jobs.amqp.conn.close()  # the connection is gone under the worker
    with pytest.raises(AmqpUnreachable) as info:
        queues.ack(held)
    assert isinstance(info.value, redis_lib.ConnectionError)
    again = open_worker(r, keys, "w1")  # the same worker, reconnected
    (back,) = again.queues([keys.prefill_stream]).read(1, 2000)
    assert back.data == b"held" and back.reclaimed
    again.close()
