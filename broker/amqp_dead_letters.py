"""Dead letters on RabbitMQ (`broker.jobs: amqp`): the farm's dead-letter queue
(`<prefix>.jobs.dead`), listed, requeued or dropped like the Redis stream's (dead_letters.py).

Two ways in: a worker dead-letters a job it must not run with its reason and job stream in the
message's headers (amqp_connection.REASON_HEADER, STREAM_HEADER); RabbitMQ dead-letters a job
delivered DELIVERY_LIMIT times by itself, with an `x-death` header naming the queue and
`delivery_limit`. A letter's id is its message id (every job is published with one, and a
dead letter keeps it), so ids stay stable while letters come and go.

A queue cannot be read without taking its messages: each action takes every letter (basic.get,
not acked), picks what it needs, and returns the rest at once (basic.nack with requeue; they
keep their place at the head). On RabbitMQ 3.x a return counts as a delivery, harmless on this
queue (no delivery limit); on 4.0-4.2, whose quorum queues default to a delivery limit of 20,
give the dead-letter queue a policy with `delivery-limit: -1`, or 20 listings drop its letters.

Requeue: the job back on its own queue, refreshed as on Redis (its time budget again from now,
a decode job without its KV lease, the request's error events removed from its output), under
the same message id (a decode job's id is what owns its request, amqp_jobs.AmqpQueues) and
confirmed, then the letter acked. A crash between the two leaves the letter queued as well.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pika
import pika.exceptions
import redis

from .amqp_connection import (
    AT_HEADER,
    CONNECTION_ERRORS,
    DEFAULT_AMQP_URL,
    REASON_HEADER,
    STREAM_HEADER,
    AmqpUnreachable,
    _safe,
    dead_letter_exchange,
    job_streams,
    queue_name,
)
from .dead_letters import DeadLetter, DeadLetterError, decode_job, error_entries, refreshed
from .keys import Keys
from .kv_store import KVStore
from .schemas import DecodeJob
from .text import as_text

log = logging.getLogger(__name__)
MAX_SCAN = 10_000  # letters one action reads at most (the oldest first)
# RabbitMQ's own reasons (x-death) in words.
DEATHS = {
    "delivery_limit": "delivered too often (the queue's delivery limit): every worker taking it failed or died",  # noqa: E501
    "rejected": "rejected by a worker",
    "expired": "expired in its queue",
    "maxlen": "dropped by its queue's length limit",
}


def _when(value: Any) -> float | None:
    """A header's time as unix seconds: ours is text (pika sends no floats), x-death's a timestamp."""
    if isinstance(value, datetime.datetime):
        return value.replace(tzinfo=value.tzinfo or datetime.timezone.utc).timestamp()
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


class AmqpDeadLetters:
    """The dead-letter queue of a farm's `keys.prefix`, for the stream keys `models` (config
    `models:`; "" = the one-model farm's): job_transport's DeadLetterStore on RabbitMQ."""

    def __init__(
        self, r: redis.Redis, keys: Keys, amqp_url: str = "", models: tuple[str, ...] = ("",)
    ):
        self.r, self.keys = r, keys
        self.url = amqp_url or DEFAULT_AMQP_URL
        self.queue = dead_letter_exchange(keys)  # the queue bound to it has its name
        self.where = f"RabbitMQ's dead-letter queue {self.queue}"
        self.sources = {
            queue_name(s): s for model in models for s in job_streams(keys.for_model(model))
        }

    # ---- reading ----------------------------------------------------------------------

    @contextmanager
    def _taken(self) -> Iterator[tuple[Any, list[tuple[int, DeadLetter]]]]:
        """Every letter (delivery tag, DeadLetter), oldest first, taken and not acked; those the
        body leaves unacked go back when it ends. A farm whose workers never declared the queue
        has no letters."""
        params = pika.URLParameters(self.url)
        params.socket_timeout = params.blocked_connection_timeout = 5
        params.connection_attempts = 1
        try:
            conn = pika.BlockingConnection(params)
        except (pika.exceptions.AMQPError, OSError) as exc:
            raise AmqpUnreachable(f"RabbitMQ at {_safe(self.url)}: {exc!r}") from exc
        try:
            ch = conn.channel()
            ch.confirm_delivery()
            try:
                ch.queue_declare(self.queue, passive=True)
            except pika.exceptions.ChannelClosedByBroker:  # NOT_FOUND: never declared
                yield None, []
                return
            taken, now = [], time.time()
            while len(taken) < MAX_SCAN:
                method, props, body = ch.basic_get(self.queue, auto_ack=False)
                if method is None:
                    break
                taken.append((method.delivery_tag, self._letter(props, body, now)))
            try:
                yield ch, taken
            finally:
                if ch.is_open and taken:  # the rest back, at the head of the queue, at once
                    ch.basic_nack(0, multiple=True, requeue=True)
        except CONNECTION_ERRORS as exc:
            raise AmqpUnreachable(repr(exc)) from exc
        finally:
            if conn.is_open:
                conn.close()

    def _letter(self, props: pika.BasicProperties, body: bytes, now: float) -> DeadLetter:
        headers = props.headers or {}
        deaths = headers.get("x-death") or [{}]
        death = deaths[0] if isinstance(deaths, list) and isinstance(deaths[0], dict) else {}
        queue = as_text(death.get("queue"))
        stream = as_text(headers.get(STREAM_HEADER)) or self.sources.get(queue, queue)
        reason = as_text(headers.get(REASON_HEADER))
        if not reason:
            why = as_text(death.get("reason"))
            reason = DEATHS.get(why, why or "unknown")
        at = _when(headers.get(AT_HEADER) or death.get("time"))
        kind = self.keys.job_kind(stream) if stream in self.sources.values() else ""
        job = decode_job(kind, body)
        return DeadLetter(
            id=props.message_id or f"body-{hashlib.sha256(body).hexdigest()[:16]}",
            stream=stream,
            source_id=props.message_id or "",
            reason=reason,
            age_s=round(now - at, 1) if at is not None else None,
            request_id=job.request_id if job else "",
            kind=kind if job else "",
            model=job.model if job else "",
            prompt_tokens=len(job.prompt_ids) if job else 0,
            requeueable=job is not None,
            data=body,
        )

    def list(self, count: int = 50) -> list[DeadLetter]:
        """The newest `count` letters, newest first (the queue holds them oldest first)."""
        with self._taken() as (_, taken):
            return [letter for _, letter in reversed(taken)][:count]

    def get(self, letter_id: str) -> DeadLetter:
        with self._taken() as (_, taken):
            return self._find(taken, letter_id)[0][1]

    @staticmethod
    def _find(taken: list[tuple[int, DeadLetter]], letter_id: str) -> list[tuple[int, DeadLetter]]:
        """The letters of one id: one, or copies of one job dead-lettered twice (amqp_jobs)."""
        found = [(tag, d) for tag, d in taken if d.id == letter_id]
        if not found:
            raise DeadLetterError(f"no dead letter {letter_id!r} (requeued or dropped already?)")
        return found

    # ---- acting -----------------------------------------------------------------------

    def requeue(self, letter_id: str, who: str = "", now: float | None = None) -> DeadLetter:
        """The job back on its own queue, refreshed (the module's doc); DeadLetterError when
        there is no such letter or its job cannot run."""
        now = time.time() if now is None else now
        with self._taken() as (ch, taken):
            found = self._find(taken, letter_id)
            letter = found[0][1]
            job = decode_job(letter.kind, letter.data)
            if job is None:
                why = "undecodable" if letter.stream in self.sources.values() else (
                    "not a job queue of this farm")  # fmt: skip
                raise DeadLetterError(
                    f"dead letter {letter_id} cannot be requeued ({why}: a worker would "
                    f"dead-letter it again); drop it instead"
                )
            errors = error_entries(self.r, job.request_id, self.keys)
            props = pika.BasicProperties(delivery_mode=2, message_id=letter.source_id or None)
            try:
                ch.basic_publish(
                    "", queue_name(letter.stream), refreshed(job, now).pack(), props, mandatory=True
                )
            except (pika.exceptions.UnroutableError, pika.exceptions.NackError) as exc:
                raise DeadLetterError(f"dead letter {letter_id}: not requeued: {exc!r}") from exc
            for tag, _ in found:  # the job is confirmed on its queue: the letter (and copies) go
                ch.basic_ack(tag)
        if errors:
            self.r.xdel(self.keys.output_stream(job.request_id), *errors)
        if isinstance(job, DecodeJob) and job.kv is not None:
            KVStore(self.r, self.keys).free(job.kv.handle_id)  # it recomputes its KV
        log.warning(
            "dead letter %s requeued%s: request %s back on %s (was: %s)",
            letter.id, f" by {who}" if who else "", job.request_id, letter.stream, letter.reason,
        )  # fmt: skip
        return letter

    def drop(self, letter_id: str, who: str = "") -> DeadLetter:
        """Delete a letter (and its copies) for good, and free its decode job's KV lease."""
        with self._taken() as (ch, taken):
            found = self._find(taken, letter_id)
            for tag, _ in found:
                ch.basic_ack(tag)
        letter = found[0][1]
        job = decode_job(letter.kind, letter.data)
        if isinstance(job, DecodeJob) and job.kv is not None:
            KVStore(self.r, self.keys).free(job.kv.handle_id)
        log.warning(
            "dead letter %s dropped%s: request %s from %s (was: %s)",
            letter.id, f" by {who}" if who else "", letter.request_id or "(undecodable)",
            letter.stream, letter.reason,
        )  # fmt: skip
        return letter

    def close(self) -> None:
        pass  # each action opens and closes its own connection
