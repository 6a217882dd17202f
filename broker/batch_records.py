"""The records of offline batches (keys: `batch_info`, `batch_jobs`, `batch_invalid`,
`batches`): what batch/jobs.py reads and writes beside rq's own job keys."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import redis

from .keys import Keys


def _keys_of(keys: Keys, bid: str) -> tuple[str, str, str]:
    return keys.batch_info(bid), keys.batch_jobs(bid), keys.batch_invalid(bid)


def create(
    r: redis.Redis, keys: Keys, bid: str, info: dict[str, Any], invalid: dict[int, dict], ttl: int
) -> None:
    """Record a new batch: its info, its invalid lines (line -> error object), its place in the
    list of batches; everything expires after `ttl` seconds unless touched."""
    with r.pipeline() as pipe:
        pipe.hset(keys.batch_info(bid), mapping=info)
        pipe.zadd(keys.batches, {bid: info["created"]})
        for line, err in invalid.items():
            pipe.hset(keys.batch_invalid(bid), str(line), json.dumps(err))
        for key in _keys_of(keys, bid):
            pipe.expire(key, ttl)
        pipe.execute()


def add_jobs(
    r: redis.Redis,
    keys: Keys,
    bid: str,
    job_ids: list[str],
    ttl: int,
    enqueue: Callable[[Any], Any],
) -> None:
    """Append job ids to a batch and queue their jobs (`enqueue(pipeline)`: rq's
    enqueue_many) in one transaction: a job is listed if and only if it is queued."""
    with r.pipeline() as pipe:
        pipe.rpush(keys.batch_jobs(bid), *job_ids)
        pipe.expire(keys.batch_jobs(bid), ttl)
        enqueue(pipe)
        pipe.execute()


def is_cancelled(r: redis.Redis, keys: Keys, bid: str) -> bool:
    return bool(r.hget(keys.batch_info(bid), "cancelled"))


def mark_cancelled(r: redis.Redis, keys: Keys, bid: str) -> None:
    r.hset(keys.batch_info(bid), "cancelled", 1)


def touch(r: redis.Redis, keys: Keys, bid: str, default_ttl: int) -> None:
    """Keep a batch's keys as long as its newest result (its own result_ttl)."""
    ttl = int(r.hget(keys.batch_info(bid), "result_ttl") or default_ttl)
    with r.pipeline(transaction=False) as pipe:
        for key in _keys_of(keys, bid):
            pipe.expire(key, ttl)
        pipe.execute()


def job_ids(r: redis.Redis, keys: Keys, bid: str) -> list[str] | None:
    """The batch's job ids in input order; None when there is no such batch."""
    if not r.exists(keys.batch_info(bid)):
        return None
    return [i.decode() for i in r.lrange(keys.batch_jobs(bid), 0, -1)]


def info(r: redis.Redis, keys: Keys, bid: str) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in r.hgetall(keys.batch_info(bid)).items()}


def invalid_lines(r: redis.Redis, keys: Keys, bid: str) -> dict[int, dict]:
    """line -> {"custom_id", "error"} for the lines that were refused at submission."""
    return {int(line): json.loads(raw) for line, raw in r.hgetall(keys.batch_invalid(bid)).items()}
