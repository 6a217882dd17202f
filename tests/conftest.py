"""Fixtures shared by every test folder: a real Redis server of our own (never the one that
may be running on 6379), and clients to it; the tokenizer of the default model; the two farm
rigs, `thread_farm` (tests/farm_threads.py: gateway and workers in threads of this process,
for fast API tests) and `proc_farm` (tests/farm_procs.py: real processes, for crash and kill
tests); and `wait_for`, the polling helper."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from syshax.broker.embedded import EmbeddedRedis
from syshax.shared.default_model import default_model_path
from syshax.shared.tokenizer import Tokenizer

from .farm_procs import ProcFarm
from .farm_threads import ThreadFarm


@pytest.fixture(scope="session")
def redis_server():
    """A real Redis server on a free port for the whole test session."""
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture
def redis_url(redis_server) -> str:
    """URL of the session server, flushed before each test so tests do not see each other."""
    redis.Redis.from_url(redis_server.url).flushall()
    return redis_server.url


@pytest.fixture
def r(redis_url) -> redis.Redis:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_model_path(default_model_path())


@pytest.fixture
def thread_farm(redis_url, tokenizer) -> Iterator[Callable[..., ThreadFarm]]:
    """Factory: thread_farm(gateway=True, workers="stub" | "echo" | None, ..., **settings) ->
    a started ThreadFarm on the session's (flushed) Redis; every one is stopped after the test.
    See ThreadFarm for the options; the other keywords are GatewaySettings overrides."""
    farms: list[ThreadFarm] = []

    def make(**kw: Any) -> ThreadFarm:
        farm = ThreadFarm(redis_url, tokenizer, **kw)
        farms.append(farm)
        return farm

    yield make
    for farm in farms:
        farm.stop()


@pytest.fixture
def proc_farm(tmp_path: Path) -> Iterator[Callable[..., ProcFarm]]:
    """Factory: proc_farm(**config) -> a ProcFarm (its own Redis, no process yet: the test
    starts the gateways and workers it needs); every one is stopped after the test."""
    farms: list[ProcFarm] = []

    def make(**config: Any) -> ProcFarm:
        farm = ProcFarm(tmp_path, **config)
        farms.append(farm)
        return farm

    yield make
    for farm in farms:
        farm.stop()


def wait_for(predicate: Callable[[], object], timeout: float = 5.0) -> bool:
    """Poll `predicate` every 20 ms until it is truthy (True) or `timeout` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False
