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


def _worker(redis_url: str, **options) -> tuple[redis.Redis, Worker]:
    """A client to read heartbeats with, and an echo worker "cpu0" that decodes on the CPU
    class, its regular heartbeat every 10 s, with `options` (WorkerOptions' fields)."""
    opts = WorkerOptions(worker_id="cpu0", roles=frozenset({"decode"}), device_class="cpu", heartbeat_s=10.0, **options)  # fmt: skip
    w = Worker(EchoEngine(max_num_seqs=4), redis.Redis.from_url(redis_url), opts, Dispatcher())
    return redis.Redis.from_url(redis_url), w


def _held(r: redis.Redis) -> int | None:
    h = r.hgetall(KEYS.worker("cpu0"))
    return int(h[b"running"]) + int(h[b"waiting"]) if h else None


def test_a_change_in_held_slots_is_beaten_within_load_beat_s(redis_url):
    r, w = _worker(redis_url)
    opts = w.opts
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


def test_before_a_prompt_only_step_the_timers_run_early(redis_url):
    """`early` (a step no stream waits on comes next): a timer due within half its period
    runs now, so it does not land between a new stream's first token and its second; a
    changed load stays rate-limited (an early beat would count the prompts about to be
    prefilled, and the dispatcher would read this worker as full right after the step)."""
    r, w = _worker(redis_url, claim_s=4.0)
    opts = w.opts
    claims: list[float] = []
    w.upkeep.claim = lambda: claims.append(t)
    t = 1000.0
    w.upkeep.on_timers(t)  # the first beat and claim round are due at once
    assert _held(r) == 0 and claims == [t]
    w.engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=4))
    t += upkeep.LOAD_BEAT_S / 4
    w.upkeep.on_timers(t)
    assert _held(r) == 0, "not early: rate-limited within LOAD_BEAT_S"
    w.upkeep.on_timers(t, early=True)
    assert _held(r) == 0, "early: the load beat stays rate-limited"
    t = 1000.0 + opts.claim_s * 0.6  # the next claim round is due at 1004.0
    w.upkeep.on_timers(t)
    assert claims == [1000.0], "not due yet"
    w.upkeep.on_timers(t, early=True)
    assert claims == [1000.0, t], "due within half its period: run early"
    w.upkeep.on_timers(t + 1.0, early=True)
    assert len(claims) == 2, "and not again before its next period"


def test_while_streams_decode_the_timers_wait_up_to_half_their_period(redis_url):
    """Mid-stream a due timer waits (up to half its period) for a step no stream waits on;
    with nothing running it runs when due."""
    r, w = _worker(redis_url, claim_s=4.0)
    opts = w.opts
    claims: list[float] = []
    w.upkeep.claim = lambda: claims.append(t)
    t = 1000.0
    w.upkeep.on_timers(t)
    w.engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=64))
    w.engine.step()  # "a" decodes now
    assert w.engine.num_running == 1
    t = 1000.0 + opts.claim_s * 1.25  # due at 1004.0, now 1005.0
    w.upkeep.on_timers(t)
    assert claims == [1000.0], "mid-stream: waits for a step no stream waits on"
    t = 1000.0 + opts.claim_s * 1.5
    w.upkeep.on_timers(t)
    assert claims == [1000.0, t], "but not past half its period"
    assert r.exists(KEYS.worker("cpu0"))
