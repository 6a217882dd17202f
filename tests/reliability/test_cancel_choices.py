"""Requests of several choices (n=3: one prefill job, choices forked on the xPU worker and
handed off one by one, their prompt and parameters stored once) cancelled at random points
leave nothing behind either: no KV lease or shared-memory segment, no stream entry, no
sequence on any worker, and no stored part or handoff mark of any request."""

from __future__ import annotations

import contextlib
import random
import time

import httpx
import pytest
from syshax.broker import choices
from syshax.broker.keys import KEYS

from ..farm_procs import ProcFarm
from .conftest import MODEL, messages
from .test_cancel_leases import check, start

N = 3


def body(i: int, max_tokens: int, stream: bool) -> dict:
    return {
        "model": MODEL,
        "messages": messages(i),
        "max_tokens": max_tokens,
        "temperature": 0.7,
        "stream": stream,
        "n": N,
    }


def one(farm: ProcFarm, i: int, seed: int) -> str:
    rng = random.Random(seed * 100_003 + i)
    mode = rng.choice(["disconnect", "disconnect", "timeout", "give_up", "complete"])
    url = farm.url() + "/v1/chat/completions"
    try:
        if mode == "disconnect":  # leave after a random number of SSE lines (0 = at once)
            lines = rng.randint(0, 60)
            with httpx.stream("POST", url, json=body(i, 300, True), timeout=30) as r:
                for n, _ in enumerate(r.iter_lines()):
                    if n >= lines:
                        break
        elif mode == "timeout":  # 6 s of generation against a 1.5 s request_timeout
            short = farm.url("short") + "/v1/chat/completions"
            with httpx.stream("POST", short, json=body(i, 300, rng.random() < 0.5)) as r:
                text = r.read().decode()
                assert r.status_code == 504 or '"code":"timeout"' in text, (r.status_code, text)
        elif mode == "give_up":  # a non-streaming client that stops waiting
            with contextlib.suppress(httpx.TimeoutException):
                httpx.post(url, json=body(i, 300, False), timeout=rng.uniform(0.1, 1.5))
        else:
            r = httpx.post(url, json=body(i, 10, False), timeout=30)
            assert r.status_code == 200, r.text
            assert [c["finish_reason"] for c in r.json()["choices"]] == ["length"] * N
    except AssertionError as exc:
        return f"{mode}: {exc}"
    return mode


@pytest.mark.slow  # ~40 s on the 2-core machine, most of it the farm's start
def test_cancelled_requests_of_several_choices_leave_nothing(proc_farm):
    from collections import Counter
    from concurrent.futures import ThreadPoolExecutor

    farm = start(proc_farm)
    with ThreadPoolExecutor(8) as pool:
        results = Counter(pool.map(lambda i: one(farm, i, 3), range(24)))
    check(farm, results, 24)
    # Deleted when each request ended. A choice handed off in the engine step between its
    # cancel and the worker's next look at the cancels writes them again: they then belong to
    # a cancelled request and expire with its deadline (bounded, never kept).
    for pattern in ("*:part:*", "*:handed:*"):
        for key in farm.r.scan_iter(pattern):
            rid = key.decode().rsplit(":", 1)[1]
            flags = [farm.r.exists(KEYS.cancel_flag(f"{rid}-{i}")) for i in range(N)]
            assert any(flags), f"{key!r} of a request that was not cancelled"
            assert 0 < farm.r.ttl(key) <= choices.part_ttl(time.time() + 600), key
