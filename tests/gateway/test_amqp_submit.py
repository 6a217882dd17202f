"""The gateway on RabbitMQ job queues (`broker.jobs: amqp`): prompts are published there
(confirmed) and the admission limit reads that queue's depth; RabbitMQ being down is a 503 in
the API's error format, never a 500 or a hang."""

from __future__ import annotations

import contextlib
import socket
import time

import httpx
from syshax.broker.amqp_connection import AmqpConnection, queue_name

from ..amqp_server import AMQP_URL, amqp_prefix, queue_counts  # noqa: F401 - the fixture
from .test_errors import MESSAGES, check_shape, post


def test_rabbitmq_down_is_a_503_with_retry_after(thread_farm):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    f = thread_farm(workers=None, jobs="amqp", amqp_url=f"amqp://guest:guest@127.0.0.1:{port}/")
    t0 = time.monotonic()
    r = post(f, "/v1/chat/completions", {"model": f.model, "messages": MESSAGES})
    err = check_shape(r, 503)
    assert r.headers["Retry-After"] and err["type"] == "service_unavailable"
    assert time.monotonic() - t0 < 5


def test_prompts_queue_on_rabbitmq_and_its_depth_admits(thread_farm, amqp_prefix):  # noqa: F811
    f = thread_farm(
        workers=None, key_prefix=amqp_prefix, jobs="amqp", amqp_url=AMQP_URL, max_queue_depth=2
    )
    conn = AmqpConnection(AMQP_URL, f.keys)  # the queues exist before the first prompt
    conn.close()
    # Two prompts waiting for a worker (none runs): their streams time out, their jobs stay.
    for _ in range(2):
        with contextlib.suppress(httpx.TimeoutException):
            body = {"model": f.model, "messages": MESSAGES}
            httpx.post(f"{f.url}/v1/chat/completions", json=body, timeout=0.5)
    deadline = time.monotonic() + 5
    while queue_counts(f.keys)[queue_name(f.keys.prefill_stream)] < 2:
        assert time.monotonic() < deadline, queue_counts(f.keys)
        time.sleep(0.05)
    assert not f.r.exists(f.keys.prefill_stream)  # not on Redis
    r = post(f, "/v1/chat/completions", {"model": f.model, "messages": MESSAGES})
    assert check_shape(r, 429)["code"] == "queue_full"
    metrics = httpx.get(f"{f.url}/metrics").text  # the queue's depth, read on RabbitMQ
    assert 'syshax:queue_length{stream="prefill"} 2.0' in metrics, metrics[:2000]
