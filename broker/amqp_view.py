"""A farm's RabbitMQ job queues as people look at them (`syshax top` with `broker.jobs: amqp`):
the jobs ready in each queue and the letters in its dead-letter queue, by passive declares
only (nothing is taken, declared or changed). RabbitMQ does not say how many of a queue's jobs
are taken and not acked through a declare: `depth` counts the ready ones."""

from __future__ import annotations

import pika
import pika.exceptions

from .amqp_connection import (
    CONNECTION_ERRORS,
    DEFAULT_AMQP_URL,
    AmqpUnreachable,
    _safe,
    dead_letter_exchange,
    queue_name,
)
from .keys import Keys


class AmqpQueueView:
    """One connection, made on first use and again after it broke (a view refreshed every
    second outlives a RabbitMQ restart)."""

    def __init__(self, keys: Keys, amqp_url: str = ""):
        self.keys, self.url = keys, amqp_url or DEFAULT_AMQP_URL
        self.dead_queue = dead_letter_exchange(keys)  # the queue bound to it has its name
        self._conn: pika.BlockingConnection | None = None
        self._channel = None

    def _ready(self, queue: str) -> int:
        """Messages ready in `queue`; 0 when it does not exist (no worker declared it yet)."""
        if self._conn is None or not self._conn.is_open:
            params = pika.URLParameters(self.url)
            params.socket_timeout = params.blocked_connection_timeout = 5
            params.connection_attempts = 1
            try:
                self._conn = pika.BlockingConnection(params)
            except (pika.exceptions.AMQPError, OSError) as exc:
                raise AmqpUnreachable(f"RabbitMQ at {_safe(self.url)}: {exc!r}") from exc
            self._channel = None
        try:
            if self._channel is None or not self._channel.is_open:
                self._channel = self._conn.channel()
            try:
                return int(self._channel.queue_declare(queue, passive=True).method.message_count)
            except pika.exceptions.ChannelClosedByBroker:  # NOT_FOUND closes the channel
                self._channel = None
                return 0
        except CONNECTION_ERRORS as exc:
            self.close()
            raise AmqpUnreachable(repr(exc)) from exc

    def depth(self, stream: str) -> int:
        """Jobs ready in a job stream's queue."""
        return self._ready(queue_name(stream))

    def dead_letters(self) -> int:
        """Letters in the farm's dead-letter queue (`syshax dead-letters list` shows them)."""
        return self._ready(self.dead_queue)

    def close(self) -> None:
        conn, self._conn, self._channel = self._conn, None, None
        try:
            if conn is not None and conn.is_open:
                conn.close()
        except Exception:  # noqa: BLE001, S110 - closing a connection that already broke
            pass
