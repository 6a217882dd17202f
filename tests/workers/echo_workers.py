"""The worker the job-reliability tests of workers/ run (test_choices.py, test_stranded_jobs.py):
an echo engine (no model) on the test's Redis, its KV in Redis, quick to notice work and
orphans."""

from __future__ import annotations

import redis
from syshax.broker.dispatcher import Dispatcher
from syshax.workers.echo_engine import EchoEngine
from syshax.workers.worker import Worker, WorkerOptions


def echo_worker(
    url: str, wid: str, roles: set[str], cls: str, tokenizer=None, max_num_seqs: int = 4
) -> Worker:
    """Worker `wid` of device class `cls` in `roles` on the Redis at `url`: KV stored in Redis,
    an idle read blocking 20 ms, a claim round every 0.2 s."""
    opts = WorkerOptions(
        worker_id=wid,
        roles=frozenset(roles),
        device_class=cls,
        kv_store="redis",
        block_ms=20,
        claim_s=0.2,
    )
    engine = EchoEngine(tokenizer, max_num_seqs=max_num_seqs)
    return Worker(engine, redis.Redis.from_url(url), opts, Dispatcher())
