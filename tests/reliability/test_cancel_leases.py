"""Requests cancelled at random points (streaming clients that disconnect mid-stream,
non-streaming clients that give up, requests that run past a short request_timeout) leave
nothing behind: no KV lease (nor shared-memory segment), no stream entry waiting or pending,
no running or waiting sequence on any worker."""

from __future__ import annotations

import contextlib
import random
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from syshax.broker.keys import KEYS

from ..farm_procs import ProcFarm
from .conftest import MODEL, messages

CLEAN = {"leases": (0, 0), "shm": [], "entries": 0, "pending": 0, "busy": {}}
STEP = 0.02  # seconds per engine step: 300 tokens take 6 s


def start(proc_farm) -> ProcFarm:
    farm = proc_farm(kv_store="auto")  # every worker on this host: KV goes through shm
    farm.start_gateway("gateway", "--disconnect-grace", "0.3")
    farm.start_gateway("short", "--request-timeout", "1.5")
    names = [farm.start_worker("xpu", roles="prefill,decode", device_class="xpu", step_delay=STEP)]
    names += [farm.start_worker(f"cpu{i}", step_delay=STEP) for i in range(2)]
    farm.wait_registered(names)
    farm.wait_healthy("gateway")
    farm.wait_healthy("short")
    return farm


def body(i: int, max_tokens: int, stream: bool) -> dict:
    return {
        "model": MODEL,
        "messages": messages(i),
        "max_tokens": max_tokens,
        "temperature": 0.7,
        "stream": stream,
    }


def one(farm: ProcFarm, i: int, seed: int) -> str:
    rng = random.Random(seed * 100_003 + i)
    mode = rng.choice(["disconnect", "disconnect", "timeout", "give_up", "complete"])
    url = farm.url() + "/v1/chat/completions"
    try:
        if mode == "disconnect":  # leave after a random number of SSE lines (0 = at once)
            lines = rng.randint(0, 40)
            with httpx.stream("POST", url, json=body(i, 300, True), timeout=30) as r:
                for n, _ in enumerate(r.iter_lines()):
                    if n >= lines:
                        break
        elif mode == "timeout":  # 6 s of generation against a 1.5 s request_timeout
            short = farm.url("short") + "/v1/chat/completions"
            stream = rng.random() < 0.5
            with httpx.stream("POST", short, json=body(i, 300, stream), timeout=30) as r:
                text = r.read().decode()
                assert r.status_code == 504 or '"code":"timeout"' in text, (r.status_code, text)
        elif mode == "give_up":  # a non-streaming client that stops waiting
            with contextlib.suppress(httpx.TimeoutException):
                httpx.post(url, json=body(i, 300, False), timeout=rng.uniform(0.1, 1.5))
        else:
            r = httpx.post(url, json=body(i, 10, False), timeout=30)
            assert r.status_code == 200, r.text
    except AssertionError as exc:
        return f"{mode}: {exc}"
    return mode


def run(farm: ProcFarm, n: int, concurrency: int, seed: int) -> Counter:
    with ThreadPoolExecutor(concurrency) as pool:
        results = Counter(pool.map(lambda i: one(farm, i, seed), range(n)))
    return results


def check(farm: ProcFarm, results: Counter, n: int) -> None:
    bad = {k: v for k, v in results.items() if ":" in k}
    assert not bad, bad
    assert sum(results.values()) == n
    handoffs = int(farm.r.get(KEYS.dispatch_count("cpu")) or 0)
    assert handoffs > 0, "some requests crossed workers through a KV lease"
    left = farm.wait_quiescent(timeout=20)
    assert left == CLEAN, left
    for name in farm.worker_names():
        assert farm.alive(name) and "Traceback" not in farm.log(name), farm.log(name)[-3000:]


def test_cancelled_requests_leave_no_lease_entry_or_sequence(proc_farm):
    farm = start(proc_farm)
    results = run(farm, 200, concurrency=16, seed=1)
    check(farm, results, 200)


@pytest.mark.slow
def test_thousand_cancelled_requests_leave_nothing(proc_farm):
    farm = start(proc_farm)
    results = run(farm, 1000, concurrency=24, seed=2)
    check(farm, results, 1000)
