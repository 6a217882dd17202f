"""The rq job of an offline batch: `run_request` sends one request line into the farm through
`FarmClient` (on the batch prefill stream, so interactive traffic goes first), keeps progress in
`job.meta` (farm request id, tokens so far, attempts) and returns the Batch API output line. A
retry after a dead worker resumes the farm request that worker started.

Queued work is data, never code. rq's default serializer is pickle, and a worker runs whatever
function a job names: anyone who can write to the queue would run code as the farm's user. So
every queue, job and worker of a batch uses JSON (`SERIALIZER`; a pickled job fails to load and
is never unpickled), and `rq_worker.BatchWorker` runs only this module's `run_request`.

The batch as a whole (submit, status, results, cancel): `batches.py`; its lines: `lines.py`;
the worker: `rq_worker.py`. See docs/batch.md.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import redis
from rq import get_current_job
from rq.job import Job
from rq.serializers import JSONSerializer
from syshax.api.errors import APIError
from syshax.api.prepare import job_ids
from syshax.batch.farm_client import FarmCancelled, FarmClient, FarmTimeout
from syshax.batch.lines import output_line
from syshax.broker import batch_records as records
from syshax.broker.keys import Keys

RESULT_TTL = 7 * 24 * 3600  # seconds results (and the batch's keys) are kept
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
        return finish(output_line(custom_id, None, None, cancel_error()), "cancelled")
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
        return finish(output_line(custom_id, None, None, cancel_error()), "cancelled")
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


def cancel_error() -> dict[str, str]:
    return {"code": "batch_cancelled", "message": "the batch was cancelled"}


def _save(job: Job | None) -> None:
    if job is not None:
        job.save_meta()


def _touch(r: redis.Redis, keys: Keys, bid: str) -> None:
    """Keep a batch's keys as long as its newest result."""
    records.touch(r, keys, bid, RESULT_TTL)
