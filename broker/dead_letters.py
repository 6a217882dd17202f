"""Dead letters: the jobs a worker set aside (`WorkQueues.dead_letter`), listed, requeued or
dropped by an operator (the dashboard's Farm page, `syshax dead-letters`).

A dead letter is an entry of `Keys.dead_letter_stream` with the stream it came from, its id
there, the reason and the job's bytes (`j`). Requeueing puts the job back at the end of its own
stream, in one MULTI with removing the dead letter, so it is never in both or in neither.

What a requeue changes in the job, and why:
- its deadline: a dead letter often outlived the one the gateway gave it, and a worker drops an
  expired job without a word; the job gets its original time budget again, from now;
- a decode job's KV lease is dropped (the job recomputes its KV from its tokens): the lease
  has usually expired by then, and a lease that could not be imported may be why it failed;
- the request's error events are removed from its output stream, so that a resume of the
  request (GET /v1/requests/{id}/stream) reads the new run, not the old failure.
A job that cannot be decoded, or came from a stream that is not a work stream of this farm,
is refused: a worker would only dead-letter it again.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass

import msgspec
import redis

from .keys import KEYS, Keys
from .kv_store import KVStore
from .schemas import DecodeJob, PrefillJob, SchemaError, entry_events
from .text import as_text

log = logging.getLogger(__name__)
MIN_BUDGET_S = 60.0  # a requeued job's time budget when its own was shorter or unknown


class DeadLetterError(LookupError):
    """No such dead letter, or one that cannot be requeued (the message says why)."""


@dataclass
class DeadLetter:
    id: str  # its id in the dead-letter stream
    stream: str  # the work stream it came from
    source_id: str  # its id there
    reason: str
    age_s: float | None  # since it was dead-lettered
    request_id: str = ""  # "" when the job cannot be decoded
    kind: str = ""  # prefill | decode | "" (undecodable)
    model: str = ""
    prompt_tokens: int = 0
    requeueable: bool = False
    data: bytes = b""

    def as_dict(self) -> dict:
        out = asdict(self)
        out.pop("data")
        return out


def _kind(stream: str, keys: Keys) -> str:
    return keys.job_kind(stream)  # any model's streams (config `models:`)


def decode_job(kind: str, data: bytes) -> PrefillJob | DecodeJob | None:
    if not kind or not data:
        return None
    try:
        return (PrefillJob if kind == "prefill" else DecodeJob).unpack(data)
    except SchemaError:
        return None


def _letter(entry_id, fields: dict, keys: Keys, now: float) -> DeadLetter:
    f = {as_text(k): v for k, v in fields.items()}
    stream, data = as_text(f.get("stream")), f.get("j") or b""
    kind = _kind(stream, keys)
    job = decode_job(kind, data)
    eid = as_text(entry_id)
    try:
        age: float | None = round(now - int(eid.split("-", 1)[0]) / 1e3, 1)
    except ValueError:
        age = None
    return DeadLetter(
        id=eid,
        stream=stream,
        source_id=as_text(f.get("id")),
        reason=as_text(f.get("reason")),
        age_s=age,
        request_id=job.request_id if job else "",
        kind=kind if job else "",
        model=job.model if job else "",
        prompt_tokens=len(job.prompt_ids) if job else 0,
        requeueable=job is not None,
        data=data if isinstance(data, bytes) else b"",
    )


def list_dead(
    r: redis.Redis, keys: Keys = KEYS, count: int = 50, now: float | None = None
) -> list[DeadLetter]:
    """The newest `count` dead letters, newest first."""
    now = time.time() if now is None else now
    rows = r.xrevrange(keys.dead_letter_stream, count=count)
    return [_letter(eid, fields, keys, now) for eid, fields in rows]


def get_dead(r: redis.Redis, entry_id: str, keys: Keys = KEYS) -> DeadLetter:
    try:
        rows = r.xrange(keys.dead_letter_stream, entry_id, entry_id)
    except redis.ResponseError as exc:  # not a stream id at all
        raise DeadLetterError(f"no dead letter {entry_id!r}: {exc}") from None
    if not rows:
        raise DeadLetterError(f"no dead letter {entry_id!r} (requeued or dropped already?)")
    return _letter(rows[0][0], rows[0][1], keys, time.time())


def refreshed(job: PrefillJob | DecodeJob, now: float) -> PrefillJob | DecodeJob:
    """The job with its time budget again from now and, for a decode job, no KV lease."""
    budget = job.deadline - job.created if job.deadline and job.created else 0.0
    changes: dict = {"deadline": now + max(budget, MIN_BUDGET_S)} if job.deadline else {}
    if isinstance(job, DecodeJob):
        changes["kv"] = None
    return msgspec.structs.replace(job, **changes)


def error_entries(r: redis.Redis, request_id: str, keys: Keys) -> list[str]:
    """Ids of the entries of a request's output stream that hold only error events (a worker
    publishes a failure on its own; an entry with tokens in it is never removed)."""
    ids = []
    for eid, fields in r.xrange(keys.output_stream(request_id)):
        try:
            events = entry_events(fields)
        except SchemaError:
            continue
        if events and all(ev.error for ev in events):
            ids.append(as_text(eid))
    return ids


def requeue(
    r: redis.Redis, entry_id: str, keys: Keys = KEYS, who: str = "", now: float | None = None
) -> DeadLetter:
    """Put a dead letter's job back on its own stream (see the module's doc for what changes).
    Raises DeadLetterError when there is no such letter or its job cannot run."""
    now = time.time() if now is None else now
    letter = get_dead(r, entry_id, keys)
    job = decode_job(_kind(letter.stream, keys), letter.data)
    if job is None:
        why = "not a work stream of this farm" if not _kind(letter.stream, keys) else "undecodable"
        raise DeadLetterError(
            f"dead letter {entry_id} cannot be requeued ({why}: a worker would dead-letter it "
            f"again); drop it instead"
        )
    errors = error_entries(r, job.request_id, keys)
    # The letter and its stream share the farm's hash slot (keys.py): one MULTI, on a Redis
    # Cluster too. The request's output has a slot of its own: cleaned after, and only once
    # the job is back (a refused requeue leaves the request's failure where it was).
    with r.pipeline(transaction=True) as pipe:
        # Two operators (or a page and a CLI) requeueing the same letter at once: the letter
        # is watched, so only the first one's job is queued; the other finds it gone.
        pipe.watch(keys.dead_letter_stream)
        if not pipe.xrange(keys.dead_letter_stream, letter.id, letter.id):
            raise DeadLetterError(f"no dead letter {entry_id!r} (requeued or dropped already?)")
        pipe.multi()
        pipe.xadd(letter.stream, {"j": refreshed(job, now).pack()})
        pipe.xdel(keys.dead_letter_stream, letter.id)
        try:
            pipe.execute()
        except redis.WatchError:
            raise DeadLetterError(
                f"dead letter {entry_id}: the dead letters changed meanwhile; try again"
            ) from None
    if errors:
        r.xdel(keys.output_stream(job.request_id), *errors)
    if isinstance(job, DecodeJob) and job.kv is not None:
        KVStore(r, keys).free(job.kv.handle_id)  # the requeued job recomputes its KV
    log.warning(
        "dead letter %s requeued%s: request %s back on %s (was: %s)",
        letter.id,
        f" by {who}" if who else "",
        job.request_id,
        letter.stream,
        letter.reason,
    )
    return letter


def drop(r: redis.Redis, entry_id: str, keys: Keys = KEYS, who: str = "") -> DeadLetter:
    """Delete a dead letter for good (and free its decode job's KV lease, if any is left)."""
    letter = get_dead(r, entry_id, keys)
    job = decode_job(_kind(letter.stream, keys), letter.data)
    if isinstance(job, DecodeJob) and job.kv is not None:
        KVStore(r, keys).free(job.kv.handle_id)
    r.xdel(keys.dead_letter_stream, letter.id)
    log.warning(
        "dead letter %s dropped%s: request %s from %s (was: %s)",
        letter.id,
        f" by {who}" if who else "",
        letter.request_id or "(undecodable)",
        letter.stream,
        letter.reason,
    )
    return letter


class RedisDeadLetters:
    """The Redis dead-letter stream as a job transport's dead letters (job_transport's
    DeadLetterStore; RabbitMQ's: amqp_dead_letters.AmqpDeadLetters)."""

    where = "the Redis dead-letter stream"

    def __init__(self, r: redis.Redis, keys: Keys = KEYS):
        self.r, self.keys = r, keys

    def list(self, count: int = 50) -> list[DeadLetter]:
        return list_dead(self.r, self.keys, count)

    def get(self, letter_id: str) -> DeadLetter:
        return get_dead(self.r, letter_id, self.keys)

    def requeue(self, letter_id: str, who: str = "") -> DeadLetter:
        return requeue(self.r, letter_id, self.keys, who)

    def drop(self, letter_id: str, who: str = "") -> DeadLetter:
        return drop(self.r, letter_id, self.keys, who)

    def close(self) -> None:
        pass  # the caller's Redis client
