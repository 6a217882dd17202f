"""Fixtures shared by every test folder: a real Redis server of our own (never the one that
may be running on 6379), and clients to it; and `wait_for`, the polling helper."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import redis
from syshax.broker.embedded import EmbeddedRedis


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


def wait_for(predicate: Callable[[], object], timeout: float = 5.0) -> bool:
    """Poll `predicate` every 20 ms until it is truthy (True) or `timeout` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False
