"""The machine's RabbitMQ for tests of `broker.jobs: amqp` (127.0.0.1:5672, guest/guest):
`amqp_prefix` gives each test a key prefix of its own (its queues' names) and deletes its
queues and dead-letter exchange afterwards; the test is skipped, saying why, where no RabbitMQ
answers."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pika
import pika.exceptions
import pytest
from syshax.broker.amqp_connection import (
    DEFAULT_AMQP_URL,
    dead_letter_exchange,
    job_streams,
    queue_name,
)
from syshax.broker.keys import Keys

AMQP_URL = DEFAULT_AMQP_URL


def connect() -> pika.BlockingConnection:
    params = pika.URLParameters(AMQP_URL)
    params.socket_timeout = params.blocked_connection_timeout = 5
    params.connection_attempts = 1
    return pika.BlockingConnection(params)


def queue_counts(keys: Keys) -> dict[str, int]:
    """Messages ready in each job queue and in the dead-letter queue of a farm."""
    conn = connect()
    try:
        ch = conn.channel()
        names = [queue_name(s) for s in job_streams(keys)] + [dead_letter_exchange(keys)]
        return {n: ch.queue_declare(n, passive=True).method.message_count for n in names}
    finally:
        conn.close()


@pytest.fixture
def amqp_prefix() -> Iterator[str]:
    try:
        conn = connect()
    except (pika.exceptions.AMQPError, OSError) as exc:
        pytest.skip(f"no RabbitMQ at {AMQP_URL} (needed for broker.jobs amqp): {exc!r}")
    conn.close()
    prefix = f"t{uuid.uuid4().hex[:10]}"
    yield prefix
    keys = Keys(prefix)
    conn = connect()
    try:
        ch = conn.channel()
        for name in [queue_name(s) for s in job_streams(keys)] + [dead_letter_exchange(keys)]:
            ch.queue_delete(name)
        ch.exchange_delete(dead_letter_exchange(keys))
    finally:
        conn.close()
