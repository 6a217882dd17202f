"""`syshax dead-letters` on RabbitMQ (`broker.jobs: amqp`, broker/amqp_dead_letters.py) against
the machine's RabbitMQ (127.0.0.1:5672; skipped, saying why, where none answers) and a real
Redis: the letters a worker set aside (with its reason) and those RabbitMQ dead-lettered itself
(the delivery limit) are listed without being consumed, requeued onto their own queue as the
Redis stream's are (fresh deadline, no KV lease, the request's error events gone, the decode
job still its request's owner), and dropped."""

from __future__ import annotations

import time

import pytest
import yaml
from syshax.broker.amqp_connection import DELIVERY_LIMIT, dead_letter_exchange, queue_name
from syshax.broker.dead_letters import DeadLetterError
from syshax.broker.job_transport import WorkerJobs, open_dead_letters
from syshax.broker.keys import Keys
from syshax.broker.kv_store import KVStore
from syshax.broker.schemas import DecodeJob, PrefillJob, TokenEvent
from syshax.broker.token_publisher import TokenPublisher

from syshax.cli import main

from ..amqp_server import amqp_prefix, queue_counts  # noqa: F401 - the fixture

CPU = "cpu"


@pytest.fixture
def keys(amqp_prefix: str) -> Keys:  # noqa: F811 - the imported fixture
    return Keys(amqp_prefix)


def _dead(r, keys: Keys, stream: str, data: bytes, reason: str) -> str:
    """A worker takes a job and dead-letters it (AmqpQueues.dead_letter); its message id."""
    jobs = WorkerJobs(r, keys, "w-dead", "amqp")
    try:
        queues = jobs.queues([stream])
        jobs.amqp.publish(stream, data)
        (entry,) = queues.read(1, 1000)
        queues.dead_letter(entry, reason)
        return entry.message_id
    finally:
        jobs.close()


def _past_the_limit(r, keys: Keys, data: bytes) -> None:
    """A prefill job returned until RabbitMQ dead-letters it by itself (x-death only)."""
    jobs = WorkerJobs(r, keys, "w-limit", "amqp")
    try:
        jobs.amqp.publish(keys.prefill_stream, data)
        ch = jobs.amqp.channel
        for _ in range(DELIVERY_LIMIT + 2):
            method, _, _ = ch.basic_get(queue_name(keys.prefill_stream))
            if method is None:
                break
            ch.basic_nack(method.delivery_tag, requeue=True)
    finally:
        jobs.close()


def test_listing_names_each_letters_job_and_reason_and_consumes_nothing(r, keys):
    now = time.time()
    job = PrefillJob(request_id="req-a", prompt_ids=[1, 2, 3], created=now, deadline=now + 30)
    first = _dead(r, keys, keys.prefill_stream, job.pack(), "engine error: boom")
    _past_the_limit(r, keys, PrefillJob(request_id="req-b", prompt_ids=[4]).pack())
    store = open_dead_letters(r, keys, "amqp")
    listed = store.list()
    assert [d.request_id for d in listed] == ["req-b", "req-a"]  # newest first
    newest, oldest = listed
    assert (oldest.id, oldest.stream, oldest.kind) == (first, keys.prefill_stream, "prefill")
    assert oldest.reason == "engine error: boom" and oldest.requeueable
    assert oldest.prompt_tokens == 3 and 0 <= oldest.age_s < 60
    assert newest.stream == keys.prefill_stream  # from RabbitMQ's x-death: the queue's stream
    assert newest.reason.startswith("delivered too often") and newest.requeueable
    assert [d.id for d in store.list()] == [d.id for d in listed]  # read again: still there
    assert [d.id for d in store.list(1)] == [newest.id]
    assert queue_counts(keys)[dead_letter_exchange(keys)] == 2
    assert store.get(first).request_id == "req-a"


def test_a_requeued_decode_job_is_refreshed_and_still_owns_its_request(r, keys):
    kv = KVStore(r, keys)
    handle = kv.put(b"kv-bytes", {"num_tokens": 3}, "req-d", store="redis")
    now = time.time()
    job = DecodeJob(request_id="req-d", prompt_ids=[1, 2, 3], output_ids=[4], kv=handle,
                    created=now - 100, deadline=now - 40)  # fmt: skip
    stream = keys.decode_stream(CPU)
    letter = _dead(r, keys, stream, job.pack(), "KV import failed")
    publisher = TokenPublisher(r, keys)  # a token delivered, then the worker's error event
    publisher.publish([TokenEvent(request_id="req-d", seq=0, token_id=4)])
    publisher.publish([TokenEvent(request_id="req-d", seq=1, error={"message": "boom"})])
    store = open_dead_letters(r, keys, "amqp")
    assert store.requeue(letter, who="test", now=now).request_id == "req-d"
    counts = queue_counts(keys)
    assert counts[dead_letter_exchange(keys)] == 0 and counts[queue_name(stream)] == 1
    jobs = WorkerJobs(r, keys, "w-next", "amqp")
    try:
        (entry,) = jobs.queues([stream]).read(1, 1000)  # not dropped as a duplicate
        assert entry.message_id == letter  # the id that owns its request (amqp_jobs)
        again = DecodeJob.unpack(entry.data)
        assert again.kv is None and again.output_ids == [4]
        assert again.deadline == pytest.approx(now + 60)  # its 60 s budget, from now
        jobs.queues([stream]).ack(entry)
    finally:
        jobs.close()
    assert not r.exists(keys.kv_lease(handle.handle_id))  # freed, not leaked
    assert [(e.seq, e.error) for e in TokenPublisher(r, keys).delivered("req-d")] == [(0, None)]


def test_drop_removes_every_copy_and_a_refused_requeue_changes_nothing(r, keys):
    garbage = _dead(r, keys, keys.prefill_stream, b"not a job", "undecodable job")
    store = open_dead_letters(r, keys, "amqp")
    with pytest.raises(DeadLetterError, match="undecodable"):
        store.requeue(garbage)
    with pytest.raises(DeadLetterError, match="no dead letter"):
        store.drop("no-such-id")
    assert queue_counts(keys)[dead_letter_exchange(keys)] == 1
    assert queue_counts(keys)[queue_name(keys.prefill_stream)] == 0
    # a job dead-lettered twice under one id (a worker died between publish and ack)
    twice = PrefillJob(request_id="req-2x", prompt_ids=[1]).pack()
    jobs = WorkerJobs(r, keys, "w-twice", "amqp")
    try:
        for _ in range(2):
            jobs.amqp.publish(keys.prefill_stream, twice, message_id="same-id")
            (entry,) = jobs.queues([keys.prefill_stream]).read(1, 1000)
            jobs.amqp.dead_letter(entry, "engine error")
    finally:
        jobs.close()
    assert [d.id for d in store.list()] == ["same-id", "same-id", garbage]
    store.drop("same-id", who="test")
    assert [d.id for d in store.list()] == [garbage]
    store.drop(garbage)
    assert queue_counts(keys)[dead_letter_exchange(keys)] == 0


def test_the_command_lists_requeues_and_drops_on_rabbitmq(r, keys, redis_url, tmp_path, capsys):
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"redis": {"prefix": keys.prefix},
                                      "broker": {"jobs": "amqp"}}))  # fmt: skip
    job = PrefillJob(request_id="req-cli", prompt_ids=[1, 2])
    letter = _dead(r, keys, keys.prefill_stream, job.pack(), "engine error: cli")
    base = ["dead-letters", "--config", str(config), "--redis-url", redis_url]
    assert main([*base, "list"]) == 0
    out = capsys.readouterr().out
    assert letter in out and "req-cli" in out and "engine error: cli" in out
    assert main([*base, "requeue", letter, "--yes"]) == 0
    assert f"{letter}: requeued on {keys.prefill_stream}" in capsys.readouterr().out
    assert queue_counts(keys)[queue_name(keys.prefill_stream)] == 1
    assert main([*base, "drop", letter, "--yes"]) == 1  # gone from the dead letters
    assert "no dead letter" in capsys.readouterr().err
    assert main([*base, "list"]) == 0 and "no dead letters" in capsys.readouterr().out


def test_the_command_says_when_rabbitmq_is_unreachable(keys, redis_url, tmp_path, capsys):
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"redis": {"prefix": keys.prefix}, "broker": {
        "jobs": "amqp", "amqp_url": "amqp://guest:guest@127.0.0.1:1/"}}))  # fmt: skip
    assert main(["dead-letters", "--config", str(config), "--redis-url", redis_url, "list"]) == 1
    assert "RabbitMQ unreachable" in capsys.readouterr().err
