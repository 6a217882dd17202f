"""`syshax top --once` shows workers, queues, dispatcher decisions and dead letters from a real
Redis."""

from __future__ import annotations

import time

from syshax.broker import farm_state
from syshax.broker.dead_letters import list_dead
from syshax.broker.keys import KEYS
from syshax.broker.schemas import PrefillJob
from syshax.broker.worker_io import Heartbeat, WorkQueues

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


def _dead_letter(r, n: int, reason: str) -> None:
    """A prefill job dead-lettered the way a worker does it (WorkQueues.dead_letter)."""
    job = PrefillJob(request_id=f"req-dead-{n}", prompt_ids=[5, 6, 7], params={}, created=1.0)
    queues = WorkQueues(r, [KEYS.prefill_stream], "gone-worker", KEYS)
    queues.ensure_groups()
    r.xadd(KEYS.prefill_stream, {"j": job.pack()})
    (entry,) = queues.read(1, None)
    queues.dead_letter(entry, reason)


def test_top_shows_the_dead_letters_and_how_to_act_on_them(redis_url, r, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "240")  # rich wraps at 80 columns off a terminal
    assert main(["top", "--once", "--redis-url", redis_url]) == 0
    assert "dead letters: none" in capsys.readouterr().out
    for n in range(7):
        _dead_letter(r, n, f"engine error {n}: [injected] for the test")
    r.xadd(KEYS.dead_letter_stream, {"stream": "elsewhere", "id": "1-0", "reason": "garbled"})

    snap = farm_state.snapshot(r, KEYS)
    dead = snap["dead_letters"]
    assert dead["count"] == 8 and len(dead["newest"]) == farm_state.DEAD_SHOWN == 5
    # The newest first, as `syshax dead-letters list` orders them (the same broker call).
    assert [d.id for d in dead["newest"]] == [d.id for d in list_dead(r, KEYS, 5)]
    assert dead["newest"][0].reason == "garbled" and not dead["newest"][0].requeueable

    assert main(["top", "--once", "--redis-url", redis_url]) == 0
    out = capsys.readouterr().out
    assert "dead letters: 8, newest 5" in out
    assert "syshax dead-letters requeue ID | drop ID" in out
    assert "(undecodable)" in out and "garbled" in out
    for n in (3, 4, 5, 6):  # the newest 4 beside the undecodable one, reasons as written
        assert f"req-dead-{n}" in out and f"engine error {n}: [injected] for the test" in out
    assert "req-dead-2" not in out  # older than the newest 5
