"""A stream entry is known by its stream and its id together: two streams give the entries
added to them in the same millisecond the same id (`<ms>-0`). The worker's take-back of
entries Redis lost and its requeue on drain went by the id alone, so one of two such entries
was taken for the other: not taken back, or not requeued (left pending under a worker that
left, until another worker's claim round found it)."""

from __future__ import annotations

import time

import redis
from syshax.broker.keys import KEYS
from syshax.broker.schemas import DecodeJob, PrefillJob
from syshax.broker.worker_io import WorkQueues
from syshax.shared.sampling import SamplingParams

from .echo_workers import echo_worker

PARAMS = SamplingParams(max_tokens=10_000, temperature=0.0).to_dict()


def test_an_entry_lost_under_our_id_is_taken_back_beside_a_held_one_of_the_same_id(r):
    streams = [KEYS.decode_stream("cpu"), KEYS.prefill_stream]
    queues = WorkQueues(r, streams, "w")
    queues.ensure_groups()
    for stream in streams:
        r.xadd(stream, {"j": b"job"}, id="5-0")
    held = [e for e in queues.read(4, None) if e.stream == streams[0]]
    time.sleep(0.01)
    lost = queues.lost_own({(e.stream, e.entry_id) for e in held}, min_idle_ms=0)
    assert [(e.stream, e.entry_id) for e in lost] == [(streams[1], "5-0")]


def test_a_draining_worker_requeues_both_jobs_of_the_same_id(redis_url):
    r = redis.Redis.from_url(redis_url)
    worker = echo_worker(redis_url, "cpu0", {"prefill", "decode"}, "cpu")
    decode = DecodeJob(request_id="d", prompt_ids=[20, 21], output_ids=[20], params=PARAMS)
    prefill = PrefillJob(request_id="p", prompt_ids=[30, 31], params=PARAMS)
    r.xadd(KEYS.decode_stream("cpu"), {"j": decode.pack()}, id="5-0")
    r.xadd(KEYS.prefill_stream, {"j": prefill.pack()}, id="5-0")
    for _ in range(4):
        worker.iterate()
    assert set(worker.jobs) == {"d", "p"}
    worker.drain(0)
    for stream in (KEYS.decode_stream("cpu"), KEYS.prefill_stream):
        assert r.xlen(stream) == 1, f"{stream}: its job back for another worker"
        assert r.xpending(stream, KEYS.prefill_group)["pending"] == 0
