"""The gateway's admission by queue depth without a Redis round trip per request (issue 31,
broker/queue_depth.py): the depth it read, plus the jobs it queued since, refuses at the limit
with the same 429; a refusal is never on a stale high value (read again first)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import redis

from .test_errors import MESSAGES, check_shape, post


def calls(r: redis.Redis, command: str) -> int:
    return int(r.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


def admission(f):
    """The cache of the farm's gateway, told not to go stale: only its rules make it read."""
    adm = f.app.state.gateway.broker.admission
    adm.max_age = 60
    return adm


def test_the_depth_read_once_counts_own_jobs_and_refuses_at_the_limit(thread_farm):
    # No worker: each admitted request times out (504) with its job still queued.
    f = thread_farm(workers=None, max_queue_depth=3, request_timeout=1)
    adm = admission(f)
    xlen, xadd = calls(f.r, "xlen"), calls(f.r, "xadd")
    body = {"model": f.model, "messages": MESSAGES}
    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda _: post(f, "/v1/chat/completions", body), range(3)))
    assert [r.status_code for r in answers] == [504] * 3, [r.text for r in answers]
    assert calls(f.r, "xlen") - xlen == 1 and adm.reads == 1  # one read for three requests
    assert calls(f.r, "xadd") - xadd == 3 and f.r.xlen(f.keys.prefill_stream) == 3
    # 3 of 3 by its own count: read again (3 queued), then the same 429 as always
    r = post(f, "/v1/chat/completions", body)
    err = check_shape(r, 429)
    assert err["code"] == "queue_full" and r.headers["Retry-After"] == "1"
    assert err["message"] == "the server is busy (3 requests waiting); retry later"
    assert adm.reads == 2


def test_a_refusal_reads_the_depth_again(thread_farm):
    f = thread_farm(workers=None, max_queue_depth=2, request_timeout=1)
    adm = admission(f)
    for _ in range(2):
        f.r.xadd(f.keys.prefill_stream, {"j": b"x"})
    body = {"model": f.model, "messages": MESSAGES}
    assert check_shape(post(f, "/v1/chat/completions", body), 429)["code"] == "queue_full"
    # The queue empties (workers took them); the cache still says 2 (it has not gone stale),
    # but a refusal is not made on it: the next request reads again and is admitted.
    f.r.delete(f.keys.prefill_stream)
    r = post(f, "/v1/chat/completions", body)
    assert r.status_code == 504, r.text  # admitted, and no worker answered it
    assert adm.reads == 2
