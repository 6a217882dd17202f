"""The worker's Redis side of a request with several choices (n > 1): one prefill job carries
the prompt and the parameters once (schemas.PrefillJob); the prefill worker forks a sequence per
choice and hands each choice's decode off on its own.

* The handoff (the job queue's `hand_over_choice`: worker_io.WorkQueues, one MULTI, or
  amqp_jobs.AmqpQueues) queues a choice's decode job, marks the choice handed off
  (`keys.handed_off`), stores the request's prompt and parameters once for every decoder
  (`keys.request_part`, on the first handoff only), and acks the prefill entry when this was
  the last choice still held. A worker that dies between two handoffs leaves the entry pending:
  whoever takes it over reads the marks (`open_choices`) and serves only the other choices,
  so no choice is decoded twice and none is lost.
* `request_part`: a decode worker reads the stored part of a choice's request (it caches it).

Both keys expire with the request (`part_ttl`) and the gateway deletes them when the request
ends (request_info.RequestInfo.end).
"""

from __future__ import annotations

import time

import redis

from .keys import Keys
from .schemas import RequestPart

NO_DEADLINE_TTL = 86_400  # seconds a part of a request without a deadline is kept
PART_TTL_MARGIN = 60  # seconds past the deadline: a decode job read then is dropped anyway


def part_ttl(deadline: float) -> int:
    """How long a request's part and marks are kept: until its deadline (after which every job
    of it is dropped unread) and a margin; a day for a job queued without one."""
    if not deadline:
        return NO_DEADLINE_TTL
    return max(1, int(deadline - time.time())) + PART_TTL_MARGIN


def open_choices(
    r: redis.Redis,
    keys: Keys,
    request_id: str,
    ids: list[str],
    reclaimed: bool = False,
    flags: bool = True,
) -> tuple[set[str], set[int]]:
    """(the choice ids cancelled, the choice indices already handed off) of a request with the
    choice ids `ids`, in one round trip (none when there is nothing to read): what a worker
    taking its prefill job must not serve. `flags`: read the cancel flags (False: the caller
    heard every cancel of this job itself, cancel_watch.py; the set returned is then empty).
    A request of one choice has a mark only from a RabbitMQ handoff (amqp_jobs.py), read
    when its job is `reclaimed` (redelivered)."""
    marks = len(ids) > 1 or reclaimed
    flagged = ids if flags else []
    if not flagged and not marks:
        return set(), set()
    pipe = r.pipeline(transaction=False)
    for cid in flagged:
        pipe.exists(keys.cancel_flag(cid))
    if marks:
        pipe.smembers(keys.handed_off(request_id))
    replies = pipe.execute()
    cancelled = {cid for cid, hit in zip(flagged, replies, strict=False) if hit}
    handed = {int(i) for i in replies[len(flagged)]} if marks else set()
    return cancelled, handed


def request_part(r: redis.Redis, keys: Keys, request_id: str) -> RequestPart | None:
    """The stored part of a request (None: expired, deleted, or never stored); SchemaError for
    one this version cannot read."""
    raw = r.get(keys.request_part(request_id))
    return None if raw is None else RequestPart.unpack(raw)
