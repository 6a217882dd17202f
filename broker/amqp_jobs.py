"""The farm's job queues on RabbitMQ (`broker.jobs: amqp`), through pika.

The prefill queue and each device class's decode queue are quorum queues: RabbitMQ replicates
a job through Raft before it confirms it, so a confirmed job survives the loss of a broker
node (Redis replicates asynchronously: an acknowledged XADD can vanish in a failover). Each has
a delivery limit (a job redelivered that often, say one that kills every worker taking it,
goes to the dead-letter exchange) and the farm's dead-letter queue behind that exchange.

At-least-once, with the same idempotent job ids as the Redis streams:

* A worker takes a job pushed to it (its own queues, amqp_push.py) or with basic.get (a queue
  it reads on demand) and acks it when the request is done with it; a worker that dies (its
  connection closes) has its unacked jobs, pushed ones included, redelivered to others, marked
  `redelivered` (taken as reclaimed jobs, resumed from their delivered tokens).
* The handoff publishes the decode job with publisher confirms, then marks the choice handed
  off on Redis (`keys.handed_off`), then acks the prefill job. A crash before the mark
  redelivers the prefill job and a second decode job may be published: every decode job
  carries a message id, and the first one taken owns its request (a Redis SET NX), so a
  duplicate is acked and dropped unread. A crash after the mark: the prefill job is redelivered
  and its handed-off choices are skipped (workers/intake.py).

Tokens, KV caches, marks and request state stay on Redis; so do batch prompts (the batch
stream, read through the Redis queues these wrap). One BlockingConnection per worker, used
from the worker's loop thread only (pika connections are not thread-safe).
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
from .kv_store import KVStore
from .schemas import DecodeJob, RequestPart
from .worker_io import Entry, WorkQueues

log = logging.getLogger(__name__)

DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
# Deliveries of one job before RabbitMQ dead-letters it: a worker killed mid-job is one.
DELIVERY_LIMIT = 10
# basic.get has no blocking form: an idle read of queues not consumed (amqp_push.py) polls
# them this often, and a Redis stream read beside consumed ones is looked at this often.
IDLE_POLL_S = 0.01
# A busy worker reads no job for a while; its connection still answers heartbeats this often.
HEARTBEAT_TICK_S = 1.0
# Seconds a decode job's owner mark is kept without a deadline (the request's life at most).
OWNER_TTL_S = 86_400
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


def owner_key(keys: Keys, request_id: str) -> str:
    """The decode job that owns a request: the message id of the first one taken."""
    return f"{keys.prefix}:decode:owner:{{{request_id}}}"


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


class AmqpQueues:
    """A worker's view of some job queues, like WorkQueues (broker/job_transport.py's
    JobQueue): RabbitMQ queues for `streams`, and `redis_queues` for the streams that stay on
    Redis (the batch stream) and for every Entry that came from Redis."""

    def __init__(
        self,
        amqp: AmqpConnection,
        r: redis.Redis,
        streams: list[str],
        consumer: str,
        redis_queues: WorkQueues,
    ):
        self.amqp, self.r, self.consumer = amqp, r, consumer
        self.keys = amqp.keys
        self.streams = [*streams, *redis_queues.streams]
        self.amqp_streams, self.redis_queues = streams, redis_queues
        self.group = redis_queues.group

    def ensure_groups(self) -> None:
        self.redis_queues.ensure_groups()

    def read(self, count: int, block_ms: int | None) -> list[Entry]:
        """Up to `count` jobs, first from RabbitMQ, then from the Redis streams; `block_ms`:
        poll until one comes or it has passed."""
        self.amqp.tick()
        if count <= 0:
            return []
        until = time.monotonic() + (block_ms or 0) / 1000
        pushed = all(self.amqp.push.consumed(s) for s in self.amqp_streams)
        while True:
            out = self._get(count)
            if len(out) < count and self.redis_queues.streams:
                out += self.redis_queues.read(count - len(out), None)
            left = until - time.monotonic()
            if out or left <= 0:
                return out
            if pushed:  # a pushed job ends the wait; a Redis stream beside is looked at as before
                self.amqp.wait(min(left, IDLE_POLL_S) if self.redis_queues.streams else left)
            else:
                time.sleep(IDLE_POLL_S)

    def _get(self, count: int) -> list[Entry]:
        out: list[Entry] = []
        for stream in self.amqp_streams:
            while len(out) < count:
                entry = self.amqp.get(stream)
                if entry is None:
                    break
                if self._duplicate(entry):
                    self.amqp.settle(entry)
                else:
                    out.append(entry)
        return out

    def _duplicate(self, entry: AmqpEntry) -> bool:
        """A decode job whose request another decode job already owns: one published twice by
        a handoff that died between its confirm and its mark. The first taken owns it; its own
        redeliveries (the same message id) still run."""
        if entry.stream == self.keys.prefill_stream or not entry.message_id or not entry.data:
            return False
        try:
            job = DecodeJob.unpack(entry.data)
        except Exception:  # noqa: BLE001 - an undecodable job: the intake dead-letters it
            return False
        ttl = max(1, int(job.deadline - time.time())) + 60 if job.deadline else OWNER_TTL_S
        key = owner_key(self.keys, job.request_id)
        if self.r.set(key, entry.message_id, nx=True, ex=ttl):
            return False
        owner = self.r.get(key)
        owner = owner.decode() if isinstance(owner, bytes) else owner
        if owner == entry.message_id:
            return False
        log.warning("dropping a duplicate decode job of %s (%s)", job.request_id, entry.stream)
        if job.kv:  # its own lease (the redone prefill's export), never the owner's
            KVStore(self.r, self.keys).free(job.kv.handle_id)
        return True

    # ---- what the Redis streams find by themselves, RabbitMQ redelivers -------------------

    def own_pending(self, count: int = 1000) -> list[Entry]:
        return self.redis_queues.own_pending(count)

    def lost_own(self, known: set[str], min_idle_ms: int = 1000) -> list[Entry]:
        return self.redis_queues.lost_own(known, min_idle_ms)

    def claim_orphans(self, live_consumers: set[str], count: int) -> list[Entry]:
        return self.redis_queues.claim_orphans(live_consumers, count)

    # ---- settling -------------------------------------------------------------------------

    def ack(self, entry: Entry) -> None:
        if isinstance(entry, AmqpEntry):
            self.amqp.settle(entry)
        else:
            self.redis_queues.ack(entry)

    def hand_over(self, entry: Entry, stream: str, data: bytes) -> None:
        """Queue a job made from `entry` on `stream` (confirmed), then ack `entry`. A decode
        job's request is marked handed off between the two (choice 0: a request of one)."""
        self.hand_over_choice(stream, data, request_id="", choice=0, ttl=0, part=None, last=entry)

    def hand_over_choice(
        self,
        stream: str,
        data: bytes,
        *,
        request_id: str,
        choice: int,
        ttl: int,
        part: RequestPart | None,
        last: Entry | None,
    ) -> None:
        """WorkQueues.hand_over_choice's steps in the order that loses nothing: the decode job
        confirmed, then the request's part and its mark (`request_id` "": the decode job's
        own, a request of one choice), then the prefill entry acked."""
        mark_id = request_id
        if not mark_id and stream != self.keys.prefill_stream:
            job = DecodeJob.unpack(data)
            mark_id = job.request_id
            ttl = max(1, int(job.deadline - time.time())) + 60 if job.deadline else OWNER_TTL_S
        if part is not None:  # before the job: its decoder reads it at once
            self.r.set(self.keys.request_part(request_id), part.pack(), ex=ttl)
        if stream in self.amqp_streams or stream in job_streams(self.keys):
            self.amqp.publish(stream, data)
        else:
            self.r.xadd(stream, {"j": data})
        if mark_id:
            pipe = self.r.pipeline(transaction=False)  # one key
            pipe.sadd(self.keys.handed_off(mark_id), choice)
            pipe.expire(self.keys.handed_off(mark_id), ttl)
            pipe.execute()
        if last is not None:
            self.ack(last)

    def requeue(self, entry: Entry) -> None:
        """Put `entry` back unchanged (a draining worker's job), its message id kept: still
        its request's owner."""
        if not isinstance(entry, AmqpEntry):
            self.redis_queues.requeue(entry)
            return
        self.amqp.publish(entry.stream, entry.data or b"", entry.message_id)
        self.amqp.settle(entry)

    def dead_letter(self, entry: Entry, reason: str) -> None:
        """A poison job: to the dead-letter queue with its reason (kept for inspection;
        `syshax dead-letters`, broker/amqp_dead_letters.py)."""
        if not isinstance(entry, AmqpEntry):
            self.redis_queues.dead_letter(entry, reason)
            return
        log.error("dead-lettering %s %s: %s", entry.stream, entry.entry_id, reason)
        self.amqp.dead_letter(entry, reason)

    def close(self) -> None:
        self.amqp.close()
