"""`syshax top` with `broker.jobs: amqp`: the prefill and decode queues' depths are RabbitMQ's
(passive declares, broker/amqp_view.py), the batch stream's Redis's, and RabbitMQ's dead
letters are counted; against the machine's RabbitMQ (skipped, saying why, where none runs)."""

from __future__ import annotations

import uuid

import pytest
import yaml
from syshax.broker.amqp_view import AmqpQueueView
from syshax.broker.farm_state import snapshot
from syshax.broker.job_transport import WorkerJobs
from syshax.broker.keys import Keys

from syshax.cli import main

from ..amqp_server import amqp_prefix  # noqa: F401 - the fixture


@pytest.fixture
def keys(amqp_prefix: str) -> Keys:  # noqa: F811 - the imported fixture
    return Keys(amqp_prefix)


def _farm(r, keys: Keys) -> None:
    """Three prompts queued on RabbitMQ, one taken and dead-lettered; a batch prompt on Redis."""
    jobs = WorkerJobs(r, keys, "w1", "amqp")
    try:
        for i in range(3):
            jobs.amqp.publish(keys.prefill_stream, f"p{i}".encode())
        queues = jobs.queues([keys.prefill_stream])
        (entry,) = queues.read(1, 1000)
        queues.dead_letter(entry, "undecodable job")
    finally:
        jobs.close()
    r.xadd(keys.prefill_batch_stream, {"j": b"batch"})


def test_the_snapshot_reads_rabbitmqs_queues(r, keys):
    _farm(r, keys)
    view = AmqpQueueView(keys)
    try:
        snap = snapshot(r, keys, amqp=view)
        assert snap["queues"]["prefill"] == (2, None)  # ready on RabbitMQ; taken: not known
        assert snap["queues"]["decode:cpu"] == (0, None)
        assert snap["queues"]["prefill:batch"] == (1, 0)  # still a Redis stream
        assert snap["rabbitmq_dead"] == 1
        # a queue no worker declared yet: 0, and the view goes on after the closed channel
        assert view.depth(Keys(f"none{uuid.uuid4().hex[:8]}").prefill_stream) == 0
        assert view.depth(keys.prefill_stream) == 2
    finally:
        view.close()
    assert snapshot(r, keys)["queues"]["prefill"] == (0, 0)  # Redis alone sees no job


def test_top_once_on_rabbitmq(r, keys, redis_url, tmp_path, capsys):
    _farm(r, keys)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"redis": {"prefix": keys.prefix},
                                      "broker": {"jobs": "amqp"}}))  # fmt: skip
    assert main(["top", "--once", "--config", str(config), "--redis-url", redis_url]) == 0
    out = capsys.readouterr().out
    assert "2 / -" in out and "1 / 0" in out  # prefill on RabbitMQ, the batch stream on Redis
    assert "dead letters on RabbitMQ: 1" in out
    config.write_text(yaml.safe_dump({"redis": {"prefix": keys.prefix}, "broker": {
        "jobs": "amqp", "amqp_url": "amqp://guest:guest@127.0.0.1:1/"}}))  # fmt: skip
    assert main(["top", "--once", "--config", str(config), "--redis-url", redis_url]) == 1
    assert "RabbitMQ unreachable" in capsys.readouterr().err
