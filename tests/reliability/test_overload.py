"""Overload: with no worker consuming, the prefill queue fills to queue.max_depth and the
gateway answers 429 with Retry-After (OpenAI's error shape) from then on; under a flood of
requests its memory stays bounded and the queue does not grow past the limit."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import psutil
import pytest
from syshax.broker.keys import KEYS

from ..farm_procs import ProcFarm
from .conftest import MODEL, messages

MAX_DEPTH = 20


@pytest.fixture(scope="module")
def farm(tmp_path_factory) -> Iterator[ProcFarm]:
    farm = ProcFarm(
        tmp_path_factory.mktemp("overload"), max_queue_depth=MAX_DEPTH, request_timeout=3
    )
    try:
        farm.start_gateway()  # and no worker at all: nothing drains the queue
        httpx_wait(farm)
        yield farm
    finally:
        farm.stop()


def httpx_wait(farm: ProcFarm) -> None:
    for _ in range(200):
        try:
            if httpx.get(farm.url() + "/v1/models", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(farm.log("gateway")[-2000:])


async def flood(farm: ProcFarm, n: int, concurrency: int) -> Counter:
    sem = asyncio.Semaphore(concurrency)
    statuses: Counter = Counter()
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=farm.url(), timeout=30, limits=limits) as client:

        async def one(i: int) -> None:
            body = {"model": MODEL, "messages": messages(i, words=4), "max_tokens": 4}
            async with sem:
                r = await client.post("/v1/chat/completions", json=body)
            if r.status_code == 429:
                assert int(r.headers["retry-after"]) >= 1
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"}
                assert err["code"] == "queue_full" and err["type"] == "rate_limit_error"
            statuses[r.status_code] += 1

        await asyncio.gather(*(one(i) for i in range(n)))
    return statuses


def test_beyond_max_depth_the_gateway_answers_429_with_retry_after(farm):
    statuses = asyncio.run(flood(farm, 80, concurrency=40))
    # Admission is a check-then-add: concurrent requests may overshoot by the concurrency.
    assert farm.r.xlen(KEYS.prefill_stream) <= MAX_DEPTH + 40
    assert statuses[429] >= 80 - MAX_DEPTH - 40
    # Accepted ones waited for a worker until request_timeout: 504, never a 5xx of ours.
    assert set(statuses) <= {429, 504}, statuses
    # A full queue answers fast: the openai client retries 429 by itself (Retry-After).
    r = httpx.post(
        farm.url() + "/v1/completions",
        json={"model": MODEL, "prompt": "hello", "max_tokens": 2},
        timeout=5,
    )
    assert r.status_code == 429


def test_gateway_memory_stays_bounded_under_a_flood(farm):
    gateway = psutil.Process(farm.procs["gateway"].pid)
    asyncio.run(flood(farm, 300, concurrency=32))  # warm up: allocator, caches, metrics
    before = gateway.memory_info().rss
    statuses = asyncio.run(flood(farm, 2000, concurrency=32))
    after = gateway.memory_info().rss
    assert statuses[429] >= 2000 - MAX_DEPTH - 32, statuses
    assert set(statuses) <= {429, 504}, statuses
    assert farm.r.xlen(KEYS.prefill_stream) <= MAX_DEPTH + 32
    growth = (after - before) / 2**20
    assert growth < 20, f"gateway RSS grew {growth:.1f} MiB over 2,000 requests"
    print(f"gateway RSS {before / 2**20:.1f} -> {after / 2**20:.1f} MiB")
