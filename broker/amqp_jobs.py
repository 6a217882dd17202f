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
stream, read through the Redis queues these wrap). The connection to RabbitMQ (one per worker,
its queues declared, publish with confirms, get, settle) is amqp_connection.py.
"""

from __future__ import annotations

import logging
import time

import redis

from .amqp_connection import AmqpConnection, AmqpEntry, job_streams
from .keys import Keys
from .kv_store import KVStore
from .schemas import DecodeJob, RequestPart
from .worker_io import Claim, Entry, WorkQueues

log = logging.getLogger(__name__)

# basic.get has no blocking form: an idle read of queues not consumed (amqp_push.py) polls
# them this often, and a Redis stream read beside consumed ones is looked at this often.
IDLE_POLL_S = 0.01
# Seconds a decode job's owner mark is kept without a deadline (the request's life at most).
OWNER_TTL_S = 86_400


def owner_key(keys: Keys, request_id: str) -> str:
    """The decode job that owns a request: the message id of the first one taken."""
    return f"{keys.prefix}:decode:owner:{{{request_id}}}"


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

    def lost_own(self, known: set[tuple[str, str]], min_idle_ms: int = 1000) -> list[Entry]:
        return self.redis_queues.lost_own(known, min_idle_ms)

    def unread(self) -> int:
        return sum(self.amqp.depth(s) for s in self.amqp_streams) + self.redis_queues.unread()

    def claim_orphans(self, live_consumers: set[str], count: int) -> Claim:
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
