"""`syshax top --once` shows workers, queues and dispatcher decisions from a real Redis."""

from __future__ import annotations

import time

from syshax.broker.keys import KEYS
from syshax.broker.worker_io import Heartbeat

from syshax.cli import main


def test_top_once_shows_the_farm(redis_url, r, capsys):
    Heartbeat(r, "cpu-w1").beat(
        roles="decode",
        device="cpu",
        device_class="cpu",
        capacity=8,
        running=3,
        waiting=1,
        decode_tps=42.5,
    )
    r.xadd(KEYS.prefill_stream, {"j": b"x"})
    r.lpush(KEYS.dispatch_log, f"{time.time():.3f} cpu [speed] CPU finishes first (1.0s vs 2.0s)")
    r.incr(KEYS.dispatch_count("cpu"))
    assert main(["top", "--once", "--redis-url", redis_url]) == 0
    out = capsys.readouterr().out
    assert "cpu-w1" in out and "3/8" in out and "42.5" in out
    assert "1 / 0" in out  # one prefill job waiting, none in flight
    assert "1 to CPU" in out and "cpu [speed] CPU finishes first" in out


def test_top_without_redis_fails_clearly(capsys):
    assert main(["top", "--once", "--redis-url", "redis://127.0.0.1:1/0"]) == 1
    assert "Redis unreachable" in capsys.readouterr().err
