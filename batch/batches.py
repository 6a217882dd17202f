"""A whole offline batch: `submit` queues its valid lines as rq jobs (one per line, on the
`<prefix>-batch` queue, `Retry(max=3, interval=[1, 5, 15])`) and records the batch (its job ids
in input order, its invalid lines with their errors; keys: `broker/keys.py`); `status`,
`results` and `cancel` read or act on it. The job itself is `jobs.run_request`."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import redis
from rq import Queue, Retry
from rq.exceptions import InvalidJobOperation
from rq.job import Job, JobStatus
from syshax.batch.jobs import RESULT_TTL, SERIALIZER, cancel_error, run_request
from syshax.batch.lines import BatchLine, output_line
from syshax.broker import batch_records as records
from syshax.broker.keys import KEYS, Keys

RETRY_MAX, RETRY_INTERVALS = 3, [1, 5, 15]
_WAITING = ("queued", "scheduled", "deferred", "created", "ready_to_enqueue", "rate_limited")
WAITING = {JobStatus(s) for s in _WAITING}  # rq states that count as "queued"
STATES = ("queued", "started", "finished", "failed", "cancelled")


def new_batch_id() -> str:
    return "batch_" + uuid.uuid4().hex[:24]


def job_id(batch_id: str, line: int) -> str:
    return f"{batch_id}-{line}"


def submit(
    r: redis.Redis,
    items: list[BatchLine],
    source: str = "",
    priority: int = 1,
    keys: Keys = KEYS,
    job_timeout: int = 660,
    result_ttl: int = RESULT_TTL,
    chunk: int = 500,
) -> str:
    """Queue every valid line as an rq job; record the batch. Returns the batch id."""
    bid = new_batch_id()
    queue = batch_queue(r, keys)
    invalid = sum(i.error is not None for i in items)
    info = {"source": source, "created": time.time(), "total": len(items), "invalid": invalid}
    info.update(priority=priority, queue=keys.batch_queue, result_ttl=result_ttl)
    invalid_lines = {
        item.line: {"custom_id": item.custom_id, "error": f"line {item.line}: {item.error}"}
        for item in items
        if item.error is not None
    }
    records.create(r, keys, bid, info, invalid_lines, result_ttl)
    valid = [i for i in items if i.error is None]
    for start in range(0, len(valid), chunk):
        part = valid[start : start + chunk]
        datas = [
            Queue.prepare_data(
                run_request,
                args=(bid, it.line, it.custom_id, it.url, it.body, priority, keys.prefix),
                job_id=job_id(bid, it.line),
                timeout=job_timeout,
                result_ttl=result_ttl,
                failure_ttl=result_ttl,
                description=f"{bid} line {it.line} ({it.custom_id}) {it.url}",
                meta={"batch_id": bid, "line": it.line, "custom_id": it.custom_id},
                retry=Retry(max=RETRY_MAX, interval=RETRY_INTERVALS),
            )
            for it in part
        ]
        ids = [job_id(bid, it.line) for it in part]
        records.add_jobs(
            r,
            keys,
            bid,
            ids,
            result_ttl,
            lambda pipe, d=datas: queue.enqueue_many(d, pipeline=pipe),
        )
    return bid


class BatchNotFound(KeyError):
    """No such batch (never submitted, or expired)."""


def _jobs(r: redis.Redis, bid: str, keys: Keys) -> list[tuple[str, Job | None]]:
    ids = records.job_ids(r, keys, bid)
    if ids is None:
        raise BatchNotFound(bid)
    jobs = Job.fetch_many(ids, connection=r, serializer=SERIALIZER)
    return list(zip(ids, jobs, strict=True))


def state(job: Job | None) -> str:
    """One of STATES for a job (a job whose key expired counts as failed)."""
    if job is None:
        return "failed"
    st = job.get_status(refresh=False)
    if st in WAITING:
        return "queued"
    if st == JobStatus.STARTED:
        return "started"
    if st in (JobStatus.CANCELED, JobStatus.STOPPED):
        return "cancelled"
    if st == JobStatus.FINISHED:
        outcome = job.meta.get("outcome", "ok")
        return {"ok": "finished", "cancelled": "cancelled"}.get(outcome, "failed")
    return "failed"


def status(r: redis.Redis, bid: str, keys: Keys = KEYS) -> dict[str, Any]:
    """Counts per state (invalid lines count as failed), tokens so far, and the batch's info."""
    jobs = _jobs(r, bid, keys)
    counts = dict.fromkeys(STATES, 0)
    tokens = 0
    for _, job in jobs:
        counts[state(job)] += 1
        tokens += int(job.meta.get("tokens", 0)) if job is not None else 0
    invalid = len(records.invalid_lines(r, keys, bid))
    counts["failed"] += invalid
    info = records.info(r, keys, bid)
    total = len(jobs) + invalid
    done = total - counts["queued"] - counts["started"]
    return {
        "id": bid,
        "total": total,
        "invalid": invalid,
        **counts,
        "tokens": tokens,
        "complete": done == total,
        "cancelled_batch": bool(info.get("cancelled")),
        "created": float(info.get("created", 0)),
        "source": info.get("source", ""),
    }


def results(r: redis.Redis, bid: str, keys: Keys = KEYS) -> Iterator[tuple[int, str, dict]]:
    """(line, state, output line) for every input line, in input order; an unfinished request's
    output has error code "not_finished"."""
    items: list[tuple[int, str, dict]] = []
    for jid, job in _jobs(r, bid, keys):
        line = int(jid.rsplit("-", 1)[1])
        st = state(job)
        custom_id = job.meta.get("custom_id", "") if job is not None else ""
        out = None
        if job is not None and job.get_status(refresh=False) == JobStatus.FINISHED:
            out = job.return_value()
        if out is None:
            out = output_line(custom_id, None, None, _job_error(job, st))
        items.append((line, st, out))
    for line, err in records.invalid_lines(r, keys, bid).items():
        message = {"code": "invalid_request", "message": err["error"]}
        items.append((line, "failed", output_line(err["custom_id"], None, None, message)))
    yield from sorted(items, key=lambda t: t[0])


def _job_error(job: Job | None, st: str) -> dict[str, str]:
    if job is None:
        return {"code": "expired", "message": "the job's record expired (result_ttl)"}
    if st in ("queued", "started"):
        return {"code": "not_finished", "message": f"the request is {st}"}
    if st == "cancelled":
        return cancel_error()
    result = job.latest_result()
    exc = (getattr(result, "exc_string", None) or "").strip().splitlines()
    message = exc[-1] if exc else "the job failed"
    return {
        "code": "failed",
        "message": f"{message} (after {job.meta.get('attempts', 0)} attempts)",
    }


def cancel(r: redis.Redis, bid: str, keys: Keys = KEYS) -> dict[str, int]:
    """Cancel a batch: waiting jobs are cancelled in rq; running ones see the flag within a
    second and cancel their farm request. Returns how many of each."""
    records.mark_cancelled(r, keys, bid)
    counts = {"cancelled": 0, "stopping": 0}
    for _, job in _jobs(r, bid, keys):
        st = state(job)
        if st == "queued" and job is not None:
            try:
                job.cancel()
                counts["cancelled"] += 1
            except InvalidJobOperation:
                pass
        elif st == "started":
            counts["stopping"] += 1
    return counts


def batch_queue(r: redis.Redis, keys: Keys = KEYS) -> Queue:
    """The farm's batch queue, with its JSON serializer."""
    return Queue(keys.batch_queue, connection=r, serializer=SERIALIZER)


# The only job functions a batch worker runs (rq names a job's function by its import path).
