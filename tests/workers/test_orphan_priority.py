"""A dead worker's jobs come before new work, also seen by a worker whose slots are full.

Orphans were claimed on the claim timer into free slots, and a busy worker's free slots are
filled by new reads on every step: under steady load a killed worker's streams waited as
long as new requests kept coming (tests/reliability/test_worker_kill.py's hundred streams
stalled past the client's 60 s timeout with a process busy beside them). Now a claim round
that leaves some for want of room stops the worker's new reads, and its next free slot goes
to a claim round at once.
"""

from __future__ import annotations

import time
import uuid

import redis
from syshax.broker.keys import KEYS
from syshax.broker.schemas import DecodeJob, TokenEvent, entry_events
from syshax.broker.worker_io import CLAIM_MIN_IDLE_MS
from syshax.shared.sampling import SamplingParams

from .echo_workers import echo_worker


def _events(r: redis.Redis, rid: str) -> list[TokenEvent]:
    return [ev for _, f in r.xrange(KEYS.output_stream(rid)) for ev in entry_events(f)]


def _queue(r: redis.Redis, max_tokens: int) -> str:
    """A decode job (first token delivered, KV to recompute) on the CPU decode stream."""
    rid = uuid.uuid4().hex
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0).to_dict()
    job = DecodeJob(
        request_id=rid,
        prompt_ids=list(range(20, 40)),
        output_ids=[20],
        params=params,
        deadline=time.time() + 60,
    )
    r.xadd(KEYS.decode_stream("cpu"), {"j": job.pack()})
    return rid


def test_a_full_worker_claims_a_dead_workers_job_and_starts_it_before_new_work(redis_url):
    r = redis.Redis.from_url(redis_url)
    worker = echo_worker(redis_url, "cpu0", {"decode"}, "cpu", max_num_seqs=2)
    worker.upkeep.start()  # registered: its heartbeat makes it the live consumer
    stream = KEYS.decode_stream("cpu")
    short, long_ = _queue(r, 12), _queue(r, 10_000)
    for _ in range(4):  # both read, recomputed, decoding
        worker.iterate()
    assert worker.engine.num_running == 2 and worker.free_slots() == 0
    assert _events(r, short)[-1].finish_reason is None
    # The dead worker's job: read under a consumer with no heartbeat, never acked.
    orphan = _queue(r, 10_000)
    assert r.xreadgroup(KEYS.prefill_group, "dead", {stream: ">"}, count=1)
    new = [_queue(r, 10_000) for _ in range(3)]  # new work queued behind it
    time.sleep(CLAIM_MIN_IDLE_MS / 1000 + 0.1)

    worker.upkeep.claim()
    pending = r.xpending_range(stream, KEYS.prefill_group, "-", "+", count=10)
    assert [p["consumer"] for p in pending] == [b"cpu0", b"cpu0", b"dead"], "no room: left"
    assert worker.upkeep.waiting == 1

    # The short job ends; its slot goes to the orphan (the publisher writes tokens in
    # batches: step until they are out).
    end = time.monotonic() + 10
    while len(_events(r, orphan)) < 3 and time.monotonic() < end:
        worker.iterate()
    assert _events(r, short)[-1].finish_reason == "length"
    assert [e.worker for e in _events(r, orphan)][-3:] == ["cpu0"] * 3, "it decodes here"
    assert all(not _events(r, rid) for rid in new), "new work waits for the next free slot"
    assert worker.engine.num_running == 2 and long_ in worker.jobs
    assert worker.upkeep.waiting == 0
    worker.drain(0.1)
