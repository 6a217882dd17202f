"""A worker whose streams come or go heartbeats within LOAD_BEAT_S, not a whole heartbeat later.

The dispatcher reads a worker's free slots from its heartbeat: with a one-second beat, a CPU
worker whose streams had just ended kept looking full for up to a second, and on 2 cores
(streams of ~3 s there) it ran a third below its slots in `bench/hetero.py`."""

from __future__ import annotations

import redis
from syshax.broker.dispatcher import Dispatcher
from syshax.broker.keys import KEYS
from syshax.shared.sampling import SamplingParams
from syshax.workers import upkeep
from syshax.workers.echo_engine import EchoEngine
from syshax.workers.worker import Worker, WorkerOptions


def _held(r: redis.Redis) -> int | None:
    h = r.hgetall(KEYS.worker("cpu0"))
    return int(h[b"running"]) + int(h[b"waiting"]) if h else None


def test_a_change_in_held_slots_is_beaten_within_load_beat_s(redis_url):
    r = redis.Redis.from_url(redis_url)
    opts = WorkerOptions(worker_id="cpu0", roles=frozenset({"decode"}), device_class="cpu", heartbeat_s=10.0)  # fmt: skip
    w = Worker(EchoEngine(max_num_seqs=4), redis.Redis.from_url(redis_url), opts, Dispatcher())
    t = 1000.0
    w.upkeep.on_timers(t)  # the first beat is due at once
    assert _held(r) == 0
    w.engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=4))
    w.upkeep.on_timers(t + upkeep.LOAD_BEAT_S / 2)
    assert _held(r) == 0, "rate-limited: not twice within LOAD_BEAT_S"
    w.upkeep.on_timers(t + 1.2 * upkeep.LOAD_BEAT_S)
    assert _held(r) == 1, "a new stream is in the heartbeat long before the next regular beat"
    r.delete(KEYS.worker("cpu0"))
    w.upkeep.on_timers(t + 2.0)
    assert _held(r) is None, "nothing changed: no beat before heartbeat_s"
    w.upkeep.on_timers(t + 1.2 * upkeep.LOAD_BEAT_S + opts.heartbeat_s)
    assert _held(r) == 1, "the regular beat"
