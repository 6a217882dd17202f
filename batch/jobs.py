"""Offline batches as rq jobs: one rq job per request line, on the `<prefix>-batch` queue.

* `parse_line` reads one JSONL line (OpenAI Batch API shape, or a bare body with custom_id);
  `submit` queues the valid ones (`Retry(max=3, interval=[1, 5, 15])`) and records the batch:
  its job ids in input order, its invalid lines with their errors (keys: `broker/keys.py`).
* `run_request` is the job: it sends the request into the farm through `FarmClient` (on the
  batch prefill stream, so interactive traffic goes first), keeps progress in `job.meta`
  (farm request id, tokens so far, attempts) and returns the Batch API output line.
* `status`, `results`, `cancel` read or act on a whole batch.
* `BatchWorker` is rq's forking worker with a shorter abandoned-job window: the started-job
  registry entry of a job whose worker died expires `abandon_after` seconds after its last
  heartbeat (rq's own default is 60 s more than the heartbeat), then rq's maintenance retries it.

Queued work is data, never code. rq's default serializer is pickle, and a worker runs whatever
function a job names: anyone who can write to the queue would run code as the farm's user. So
every queue, job and worker here uses JSON (`SERIALIZER`; a pickled job fails to load and is
never unpickled), and `BatchWorker` runs only `ALLOWED_FUNCTIONS`: any other job is failed with
the reason, without being executed.

See docs/batch.md.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import redis
from rq import Queue, Retry, Worker, get_current_job
from rq.exceptions import DeserializationError, InvalidJobOperation
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer
from rq.worker import WorkerStatus
from syshax.api.errors import APIError
from syshax.api.prepare import job_ids
from syshax.batch.farm_client import FarmCancelled, FarmClient, FarmTimeout, endpoint_kind
from syshax.broker import batch_records as records
from syshax.broker.keys import KEYS, Keys

RESULT_TTL = 7 * 24 * 3600  # seconds results (and the batch's keys) are kept
RETRY_MAX, RETRY_INTERVALS = 3, [1, 5, 15]
_WAITING = ("queued", "scheduled", "deferred", "created", "ready_to_enqueue", "rate_limited")
WAITING = {JobStatus(s) for s in _WAITING}  # rq states that count as "queued"
STATES = ("queued", "started", "finished", "failed", "cancelled")
SERIALIZER = JSONSerializer  # never pickle: see the module doc

_client: FarmClient | None = None  # set in the worker's parent process: forked horses share it


class FarmError(Exception):
    """The farm answered with a server error (retried while retries are left)."""


def set_client(client: FarmClient | None) -> None:
    global _client
    _client = client


def farm_client() -> FarmClient:
    """The process's FarmClient; built from the config ($SYSHAX_CONFIG) when a plain
    `rq worker` runs the job."""
    global _client
    if _client is None:
        from syshax.batch.farm_client import settings_from_config
        from syshax.shared.config import load_config

        _client = FarmClient.from_settings(settings_from_config(load_config()))
    return _client


# ---- parsing ---------------------------------------------------------------------------------
@dataclass
class BatchLine:
    line: int  # 1-based line number in the input
    custom_id: str
    url: str = ""
    body: dict[str, Any] | None = None
    error: str | None = None  # why the line cannot be queued


def parse_line(line: int, text: str) -> BatchLine | None:
    """One input line; None for a blank line. Accepts {"custom_id", "method", "url", "body"}
    and a bare body with custom_id (the endpoint is told by `messages` / `prompt`)."""
    if not text.strip():
        return None
    default_id = f"line-{line}"
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        return BatchLine(line, default_id, error=f"invalid JSON: {exc}")
    if not isinstance(obj, dict):
        return BatchLine(line, default_id, error="a line must be a JSON object")
    custom_id = obj.get("custom_id", default_id)
    if not isinstance(custom_id, str) or not custom_id:
        return BatchLine(line, default_id, error="custom_id must be a non-empty string")
    if "body" in obj or "url" in obj or "method" in obj:
        body, url = obj.get("body"), obj.get("url")
        if not isinstance(body, dict):
            return BatchLine(line, custom_id, error="missing body (a JSON object)")
        if obj.get("method", "POST") != "POST":
            return BatchLine(line, custom_id, error=f"unsupported method {obj.get('method')!r}")
        if not isinstance(url, str):
            return BatchLine(line, custom_id, error="missing url")
    else:
        body = {k: v for k, v in obj.items() if k != "custom_id"}
        url = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        if "messages" not in body and "prompt" not in body:
            return BatchLine(line, custom_id, error="missing body (no messages or prompt)")
    try:
        endpoint_kind(url)
    except APIError as exc:
        return BatchLine(line, custom_id, error=exc.message)
    return BatchLine(line, custom_id, url, body)


def parse_lines(lines: Iterable[str]) -> list[BatchLine]:
    """Every non-blank line; a custom_id seen before makes the later line invalid."""
    out, seen = [], {}
    for no, text in enumerate(lines, 1):
        item = parse_line(no, text)
        if item is None:
            continue
        if item.error is None and item.custom_id in seen:
            item.error = (
                f"duplicate custom_id {item.custom_id!r} (first on line {seen[item.custom_id]})"
            )
        seen.setdefault(item.custom_id, no)
        out.append(item)
    return out


# ---- submitting ------------------------------------------------------------------------------
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


# ---- the job ---------------------------------------------------------------------------------
def output_line(custom_id: str, status: int | None, body: Any, error: Any = None) -> dict:
    """One line of the OpenAI Batch output format."""
    response = None
    if status is not None:
        response = {"status_code": status, "request_id": (body or {}).get("id", ""), "body": body}
    rid = "batch_req_" + uuid.uuid4().hex[:24]
    return {"id": rid, "custom_id": custom_id, "response": response, "error": error}


def run_request(
    batch_id: str,
    line: int,
    custom_id: str,
    url: str,
    body: dict[str, Any],
    priority: int = 1,
    prefix: str = "syshax",
) -> dict[str, Any]:
    """The rq job: one request through the farm. A retry after a dead worker resumes the farm
    request that worker started (its output stream is authoritative), instead of sending it
    again. Timeouts and server errors raise (rq retries them); 4xx answers are results."""
    job = get_current_job()
    client, keys = farm_client(), Keys(prefix)
    meta = job.meta if job is not None else {}
    meta["attempts"] = meta.get("attempts", 0) + 1
    _save(job)  # counted at once: an attempt may die before anything else is saved

    def finish(out: dict[str, Any], outcome: str, status: int | None = None) -> dict[str, Any]:
        meta.update(outcome=outcome, status_code=status, finished_at=time.time())
        _save(job)
        return out

    def cancelled() -> bool:
        return records.is_cancelled(client.r, keys, batch_id)

    if cancelled():
        return finish(output_line(custom_id, None, None, _cancel_error()), "cancelled")
    try:
        plan = client.prepare(url, body)
    except APIError as exc:
        return finish(output_line(custom_id, exc.status, exc.body()), "error", exc.status)
    prev, prev_deadline = meta.get("request_id"), float(meta.get("deadline") or 0)
    if prev and time.time() < prev_deadline:
        plan = replace(plan, request_id=prev, deadline=prev_deadline)  # resume it
    else:
        if prev:
            client.cancel(job_ids(prev, plan.n))
        client.submit(plan, priority)
        meta.update(request_id=plan.request_id, deadline=plan.deadline, tokens=0)
        _save(job)

    last_save = [time.monotonic()]

    def progress(tokens: int) -> None:
        if tokens != meta.get("tokens") and time.monotonic() - last_save[0] >= 0.5:
            meta["tokens"] = tokens
            last_save[0] = time.monotonic()
            _save(job)

    try:
        res = client.collect(plan, on_progress=progress, should_cancel=cancelled)
    except FarmCancelled:
        return finish(output_line(custom_id, None, None, _cancel_error()), "cancelled")
    except FarmTimeout:
        meta.pop("request_id", None)  # cancelled: a retry sends the request anew
        _save(job)
        raise
    meta["tokens"] = res.tokens
    if res.status_code >= 500 and job is not None and (job.retries_left or 0) > 0:
        meta.pop("request_id", None)
        _save(job)
        raise FarmError(f"farm answered {res.status_code}: {res.body}")
    _touch(client.r, keys, batch_id)
    outcome = "ok" if res.ok else "error"
    return finish(output_line(custom_id, res.status_code, res.body), outcome, res.status_code)


def _cancel_error() -> dict[str, str]:
    return {"code": "batch_cancelled", "message": "the batch was cancelled"}


def _save(job: Job | None) -> None:
    if job is not None:
        job.save_meta()


def _touch(r: redis.Redis, keys: Keys, bid: str) -> None:
    """Keep a batch's keys as long as its newest result."""
    records.touch(r, keys, bid, RESULT_TTL)


# ---- a whole batch ---------------------------------------------------------------------------
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
        return _cancel_error()
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
ALLOWED_FUNCTIONS = frozenset({f"{run_request.__module__}.{run_request.__qualname__}"})


def refusal(job: Job) -> str | None:
    """Why a batch worker must not run `job`, or None. Loading the job's data is safe: JSON."""
    try:
        name = job.func_name
    except DeserializationError:
        return f"job {job.id} refused: its data is not JSON (pickled jobs are never loaded)"
    if name not in ALLOWED_FUNCTIONS:
        return (
            f"job {job.id} refused: function {name!r} is not a farm batch function "
            f"(allowed: {', '.join(sorted(ALLOWED_FUNCTIONS))})"
        )
    return None


class BatchWorker(Worker):
    """rq's forking worker, with JSON jobs and only the farm's own job functions (`refusal`); a
    dead worker's job is found abandoned `abandon_after` s after its last heartbeat (sent every
    `job_monitoring_interval` s) instead of rq's 60 s margin."""

    abandon_after: int = 15

    def __init__(self, *args: Any, **kw: Any) -> None:
        kw["serializer"] = SERIALIZER
        super().__init__(*args, **kw)

    def execute_job(self, job: Job, queue: Queue) -> None:
        reason = refusal(job)
        if reason is None:
            super().execute_job(job, queue)
            return
        # Failed at once, never retried, never forked or imported: the reason is the result.
        self.log.error("%s", reason)
        job.retries_left = 0
        execution = self.prepare_execution(job)
        self.handle_job_failure(job, queue, exc_string=reason, execution=execution)
        self.set_state(WorkerStatus.IDLE)

    def get_heartbeat_ttl(self, job: Job, working_time: float = 0.0) -> int:
        interval = self.job_monitoring_interval
        if job.timeout and job.timeout > 0:
            interval = min(interval, max(1, int(job.timeout - working_time)))
        return int(interval) + self.abandon_after
