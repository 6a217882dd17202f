"""The farm's connection to RabbitMQ (`broker.jobs: amqp`), through pika: `AmqpConnection`,
one BlockingConnection and channel with publisher confirms and every job queue declared (quorum
queues with a delivery limit, behind the farm's dead-letter exchange), which publishes a job and
waits for its confirm, takes one (pushed, amqp_push.py, or by basic.get), acks or rejects it,
dead-letters it with its reason, and answers heartbeats. Also the names the farm's queues have
on RabbitMQ (`queue_name`, `job_streams`, `dead_letter_exchange`), `AmqpEntry` (a job taken
from RabbitMQ) and `AmqpUnreachable` (RabbitMQ went away). amqp_jobs.py builds a worker's job
queues on it; the gateway publishes prefill jobs through it (job_transport.AsyncJobs).

One connection per worker, used from the worker's loop thread only (pika connections are not
thread-safe).
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass

import pika
import pika.exceptions
import redis

from .amqp_push import PushBuffers
from .keys import DEVICE_CLASSES, Keys
from .worker_io import Entry

log = logging.getLogger(__name__)

DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
# Deliveries of one job before RabbitMQ dead-letters it: a worker killed mid-job is one.
DELIVERY_LIMIT = 10
# A busy worker reads no job for a while; its connection still answers heartbeats this often.
HEARTBEAT_TICK_S = 1.0
# Headers of a job a worker dead-letters itself (`AmqpConnection.dead_letter`): why, and the
# job stream it came from (RabbitMQ's own x-death says only "rejected" and the queue).
REASON_HEADER, STREAM_HEADER, AT_HEADER = "x-syshax-reason", "x-syshax-stream", "x-syshax-at"
# pika's errors that mean the connection (or channel) is gone.
CONNECTION_ERRORS = (pika.exceptions.AMQPConnectionError, pika.exceptions.AMQPChannelError)


class AmqpUnreachable(redis.ConnectionError):
    """RabbitMQ went away. A redis.ConnectionError on purpose: the worker's loop already
    handles that one (workers/process.py: abort the engine's sequences, which the broker
    redelivers once this connection is closed, and reconnect with a backoff)."""


def queue_name(stream: str) -> str:
    """The queue of a job stream: its name without the Redis hash-tag braces."""
    return stream.replace("{", "").replace("}", "")


def dead_letter_exchange(keys: Keys) -> str:
    return f"{keys.prefix}.jobs.dead"


def job_streams(keys: Keys) -> list[str]:
    """The streams that are RabbitMQ queues in amqp mode (the batch stream stays on Redis)."""
    return [keys.prefill_stream, *(keys.decode_stream(c) for c in DEVICE_CLASSES)]


@dataclass
class AmqpEntry(Entry):
    delivery_tag: int = 0
    message_id: str = ""


class AmqpConnection:
    """One connection and channel (publisher confirms on) with every job queue declared."""

    def __init__(self, url: str | None, keys: Keys):
        self.url, self.keys = url or DEFAULT_AMQP_URL, keys
        try:
            params = pika.URLParameters(self.url)
            params.heartbeat = params.heartbeat or 60
            self.conn = pika.BlockingConnection(params)
            self.channel = self.conn.channel()
            self.channel.confirm_delivery()
            self.declare()
        except CONNECTION_ERRORS as exc:
            raise AmqpUnreachable(f"RabbitMQ at {_safe(self.url)}: {exc!r}") from exc
        self._ticked = time.monotonic()
        self.push = PushBuffers(self.channel)  # the queues consumed (amqp_push.py)

    def declare(self) -> None:
        """The dead-letter exchange and queue, and every job queue as a quorum queue."""
        ch, dlx = self.channel, dead_letter_exchange(self.keys)
        ch.exchange_declare(dlx, exchange_type="fanout", durable=True)
        ch.queue_declare(dlx, durable=True, arguments={"x-queue-type": "quorum"})
        ch.queue_bind(dlx, dlx)
        for stream in job_streams(self.keys):
            ch.queue_declare(
                queue_name(stream),
                durable=True,
                arguments={
                    "x-queue-type": "quorum",
                    "x-delivery-limit": DELIVERY_LIMIT,
                    "x-dead-letter-exchange": dlx,
                },
            )

    def publish(self, stream: str, data: bytes, message_id: str = "") -> str:
        """Publish a job and wait for RabbitMQ's confirm (the quorum's commit); its message id."""
        message_id = message_id or uuid.uuid4().hex
        props = pika.BasicProperties(delivery_mode=2, message_id=message_id)
        try:
            self.channel.basic_publish("", queue_name(stream), data, props, mandatory=True)
        except (pika.exceptions.UnroutableError, pika.exceptions.NackError) as exc:
            raise AmqpUnreachable(f"job not confirmed on {queue_name(stream)}: {exc!r}") from exc
        except CONNECTION_ERRORS as exc:
            raise AmqpUnreachable(repr(exc)) from exc
        return message_id

    def consume(self, stream: str, prefetch: int) -> None:
        """Have RabbitMQ push `stream`'s jobs here (amqp_push.py); `get` then takes them."""
        try:
            self.push.consume(stream, queue_name(stream), prefetch)
        except CONNECTION_ERRORS as exc:
            raise AmqpUnreachable(repr(exc)) from exc

    def stop_consuming(self) -> None:
        try:
            self.push.stop()
        except CONNECTION_ERRORS as exc:
            raise AmqpUnreachable(repr(exc)) from exc

    def get(self, stream: str) -> AmqpEntry | None:
        """One job of `stream`: a pushed one of a consumed queue, else by basic.get."""
        if self.push.cancelled:
            raise AmqpUnreachable(f"RabbitMQ cancelled the consumer of {self.push.cancelled}")
        try:
            if self.push.consumed(stream):
                delivery = self.push.pop(stream)
                if delivery is None:
                    self.conn.process_data_events(0)  # what has arrived meanwhile
                    delivery = self.push.pop(stream)
                method, props, body = delivery or (None, None, b"")
            else:
                method, props, body = self.channel.basic_get(queue_name(stream), auto_ack=False)
        except CONNECTION_ERRORS as exc:
            raise AmqpUnreachable(repr(exc)) from exc
        self._ticked = time.monotonic()
        if method is None:
            return None
        return AmqpEntry(
            stream,
            f"amqp:{method.delivery_tag}",
            body,
            reclaimed=bool(method.redelivered),
            delivery_tag=method.delivery_tag,
            message_id=props.message_id or "",
        )

    def settle(self, entry: AmqpEntry, ok: bool = True) -> None:
        """Ack (`ok`) or reject to the dead-letter exchange."""
        try:
            if ok:
                self.channel.basic_ack(entry.delivery_tag)
            else:
                self.channel.basic_reject(entry.delivery_tag, requeue=False)
        except CONNECTION_ERRORS as exc:
            raise AmqpUnreachable(repr(exc)) from exc

    def dead_letter(self, entry: AmqpEntry, reason: str) -> None:
        """Publish a poison job to the dead-letter exchange with the reason and its stream,
        confirmed, then ack it (a reject would record only "rejected"). A crash between the two
        dead-letters it twice under one message id: `syshax dead-letters` acts on both."""
        headers = {REASON_HEADER: reason[:2000], STREAM_HEADER: entry.stream, AT_HEADER: f"{time.time():.3f}"}  # fmt: skip
        props = pika.BasicProperties(
            delivery_mode=2, message_id=entry.message_id or uuid.uuid4().hex, headers=headers
        )
        try:
            dlx = dead_letter_exchange(self.keys)
            self.channel.basic_publish(dlx, "", entry.data or b"", props, mandatory=True)
        except (pika.exceptions.UnroutableError, pika.exceptions.NackError) as exc:
            raise AmqpUnreachable(f"dead letter not confirmed: {exc!r}") from exc
        except CONNECTION_ERRORS as exc:
            raise AmqpUnreachable(repr(exc)) from exc
        self.settle(entry)

    def depth(self, stream: str) -> int:
        """Jobs ready in a queue (not counting those taken and not yet acked)."""
        try:
            ok = self.channel.queue_declare(queue_name(stream), passive=True)
        except CONNECTION_ERRORS as exc:
            raise AmqpUnreachable(repr(exc)) from exc
        return int(ok.method.message_count)

    def wait(self, seconds: float) -> None:
        """Block until a job is pushed here or `seconds` have passed (an idle worker)."""
        try:
            self.conn.process_data_events(max(seconds, 0.0))
        except CONNECTION_ERRORS as exc:
            raise AmqpUnreachable(repr(exc)) from exc
        self._ticked = time.monotonic()

    def tick(self) -> None:
        """Answer heartbeats while no job is read (a worker whose slots are all busy)."""
        now = time.monotonic()
        if now - self._ticked >= HEARTBEAT_TICK_S:
            self._ticked = now
            try:
                self.conn.process_data_events(0)
            except CONNECTION_ERRORS as exc:
                raise AmqpUnreachable(repr(exc)) from exc

    def close(self) -> None:
        try:
            if self.conn.is_open:
                self.conn.close()
        except Exception as exc:  # noqa: BLE001 - closing a connection that already broke
            log.debug("closing the AMQP connection: %r", exc)


def _safe(url: str) -> str:
    """The URL without its password (for messages)."""
    params = pika.URLParameters(url)
    return f"{params.host}:{params.port}{params.virtual_host}"
