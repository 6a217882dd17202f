"""The Farm page's state with `broker.jobs: amqp`: the prefill and decode queues are shown with
RabbitMQ's ready jobs (transport rabbitmq; taken ones not known), the batch stream Redis's,
and RabbitMQ's dead letters counted; against the machine's RabbitMQ (skipped, saying why,
where none runs)."""

from __future__ import annotations

import pytest
from syshax.broker.job_transport import WorkerJobs
from syshax.broker.keys import Keys

from syshax.farm_page.app import FarmPageSettings, make_app

from ..amqp_server import amqp_prefix  # noqa: F401 - the fixture


@pytest.fixture
def keys(amqp_prefix: str) -> Keys:  # noqa: F811 - the imported fixture
    return Keys(amqp_prefix)


def test_the_state_reads_rabbitmqs_queues(r, keys, redis_url):
    jobs = WorkerJobs(r, keys, "w1", "amqp")
    try:
        for i in range(3):
            jobs.amqp.publish(keys.decode_stream("cpu"), f"d{i}".encode())
        queues = jobs.queues([keys.decode_stream("cpu")])
        (entry,) = queues.read(1, 1000)
        queues.dead_letter(entry, "KV import failed")
    finally:
        jobs.close()
    r.xadd(keys.prefill_batch_stream, {"j": b"batch"})
    settings = FarmPageSettings(redis_url=redis_url, keys=keys, jobs="amqp")
    client = make_app(settings).test_client()
    reply = client.get("/farm/state.json")
    assert reply.status_code == 200, reply.get_json()
    state = reply.get_json()
    streams = {s["name"]: s for s in state["streams"]}
    cpu = streams["decode:cpu"]
    assert (cpu["transport"], cpu["length"], cpu["waiting"], cpu["pending"]) == (
        "rabbitmq", 2, 2, None
    )  # fmt: skip
    batch = streams["prefill:batch"]
    assert (batch["transport"], batch["length"], batch["pending"]) == ("redis", 1, 0)
    assert state["rabbitmq_dead"] == 1 and state["dead_letters"]["length"] == 0
    on_redis = make_app(FarmPageSettings(redis_url=redis_url, keys=keys)).test_client()
    plain = on_redis.get("/farm/state.json").get_json()
    assert plain["rabbitmq_dead"] is None
    assert {s["name"]: s["length"] for s in plain["streams"]}["decode:cpu"] == 0


def test_rabbitmq_down_is_a_503_that_says_so(keys, redis_url):
    url = "amqp://guest:guest@127.0.0.1:1/"
    settings = FarmPageSettings(redis_url=redis_url, keys=keys, jobs="amqp", amqp_url=url)
    reply = make_app(settings).test_client().get("/farm/state.json")
    assert reply.status_code == 503 and "RabbitMQ unreachable" in reply.get_json()["error"]
