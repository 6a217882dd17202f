"""A request with n choices is one prefill job: the worker prefills the prompt once, forks a
sequence per choice (sharing the prompt's KV blocks through the prefix cache), hands each
choice's decode off on its own with the prompt and parameters stored once in Redis, and acks
the prefill entry after the last choice. A prefill worker that dies between two handoffs
leaves the entry to another, which serves only the choices not handed off: every choice ends
exactly once, every token once."""

from __future__ import annotations

import threading
import uuid

import pytest
import redis
from syshax.broker import choices
from syshax.broker.keys import KEYS
from syshax.broker.kv_store import KVStore
from syshax.broker.schemas import DecodeJob, PrefillJob, RequestPart, TokenEvent, entry_events
from syshax.broker.worker_io import WorkQueues
from syshax.shared.sampling import SamplingParams
from syshax.workers.worker import Worker

from ..conftest import wait_for
from .echo_workers import echo_worker

PROMPT = list(range(100, 140))  # 40 tokens: two full KV blocks of 16 and a partial one
MAX_TOKENS = 8


def _worker(url: str, wid: str, roles: set[str], cls: str, tokenizer=None) -> Worker:
    return echo_worker(url, wid, roles, cls, tokenizer, max_num_seqs=8)


def _events(r: redis.Redis, cid: str) -> list[TokenEvent]:
    """Every event written to a choice's output stream, repeats included."""
    return [ev for _, f in r.xrange(KEYS.output_stream(cid)) for ev in entry_events(f)]


def _queue(r: redis.Redis, n: int, **params) -> PrefillJob:
    p = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, seed=7, **params)
    job = PrefillJob(request_id=uuid.uuid4().hex, prompt_ids=PROMPT, params=p.to_dict(), n=n)
    r.xadd(KEYS.prefill_stream, {"j": job.pack()})
    return job


def _finished(r: redis.Redis, job: PrefillJob) -> bool:
    return all((_events(r, c) or [TokenEvent()])[-1].finish_reason for c in job.choice_ids())


def _check_outputs(r: redis.Redis, job: PrefillJob) -> list[list[TokenEvent]]:
    out = []
    for cid in job.choice_ids():
        evs = _events(r, cid)
        assert [e.seq for e in evs] == list(range(MAX_TOKENS)), "every token once, in order"
        assert [e.token_id for e in evs] == PROMPT[:MAX_TOKENS]
        assert evs[-1].finish_reason == "length"
        out.append(evs)
    return out


def _serve(workers: list[Worker]) -> tuple[threading.Event, list[threading.Thread]]:
    stop = threading.Event()
    threads = [threading.Thread(target=w.serve, args=(stop, 2.0), daemon=True) for w in workers]
    for t in threads:
        t.start()
    return stop, threads


def test_one_job_prefills_the_prompt_once_and_forks_every_choice(redis_url):
    r = redis.Redis.from_url(redis_url)
    worker = _worker(redis_url, "xpu", {"prefill", "decode"}, "xpu")
    job = _queue(r, 3)
    stop, threads = _serve([worker])
    try:
        assert wait_for(lambda: _finished(r, job), 10)
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    for evs in _check_outputs(r, job):
        assert {e.worker for e in evs} == {"xpu"}
    blocks = worker.engine.scheduler.blocks
    # Choices 1 and 2 started after choice 0 computed the prompt: each found its two full
    # blocks in the prefix cache (none would with the three prompts computed together).
    assert blocks.hits == 2 * 2, (blocks.hits, blocks.queries)
    assert r.xlen(KEYS.prefill_stream) == 0, "the one entry acked after the last choice"
    assert r.exists(KEYS.request_part(job.request_id)) == 0, "nothing handed off, nothing stored"


def test_choices_hand_off_with_the_prompt_and_params_stored_once(redis_url, tokenizer):
    r = redis.Redis.from_url(redis_url)
    stop_words = [f"never-{i}" for i in range(200)]
    job = _queue(r, 3, stop=stop_words)
    # A prefill-only worker and no decoder yet: the decode jobs wait on the xpu stream.
    stop, threads = _serve([_worker(redis_url, "xpu", {"prefill"}, "xpu", tokenizer)])
    try:
        stream = KEYS.decode_stream("xpu")
        assert wait_for(lambda: r.xlen(stream) == 3, 10)
        assert wait_for(lambda: r.xlen(KEYS.prefill_stream) == 0, 5), "acked with the last"
        decodes = [DecodeJob.unpack(f[b"j"]) for _, f in r.xrange(stream)]
        assert sorted(d.choice for d in decodes) == [0, 1, 2]
        assert {d.request_id for d in decodes} == set(job.choice_ids())
        for d in decodes:  # no copy of the prompt or the 200 stop strings in any of them
            assert d.part_of == job.request_id and d.prompt_ids == [] and d.params == {}
            assert len(d.pack()) < 600
        part = RequestPart.unpack(r.get(KEYS.request_part(job.request_id)))
        assert part.prompt_ids == PROMPT and part.params == job.params
        assert r.smembers(KEYS.handed_off(job.request_id)) == {b"0", b"1", b"2"}
        assert 0 < r.ttl(KEYS.request_part(job.request_id)) <= choices.NO_DEADLINE_TTL
        decoder = _worker(redis_url, "cpu0", {"decode"}, "cpu", tokenizer)
        threads.append(threading.Thread(target=decoder.serve, args=(stop, 2.0), daemon=True))
        threads[-1].start()
        assert wait_for(lambda: _finished(r, job), 10)
        assert wait_for(lambda: r.xlen(stream) == 0, 5)
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    for evs in _check_outputs(r, job):
        assert [e.worker for e in evs] == ["xpu"] + ["cpu0"] * (MAX_TOKENS - 1)
    assert KVStore(r).stats() == (0, 0)


class Died(Exception):
    """The prefill worker's process ends here (its next MULTI is never sent)."""


def test_a_prefill_worker_dying_between_handoffs_loses_and_repeats_nothing(redis_url, monkeypatch):
    r = redis.Redis.from_url(redis_url)
    job = _queue(r, 3)
    real = WorkQueues.hand_over_choice
    handed: list[int] = []

    def dies_at_the_second(queue, stream, data, **kw):
        if queue.consumer == "xpu-a" and handed:
            raise Died()
        real(queue, stream, data, **kw)
        handed.append(kw["choice"])

    monkeypatch.setattr(WorkQueues, "hand_over_choice", dies_at_the_second)
    a = _worker(redis_url, "xpu-a", {"prefill"}, "xpu")
    with pytest.raises(Died):
        for _ in range(100):
            a.iterate()
    a.heartbeat.remove()  # dead: its heartbeat is gone, its entry pending under its name
    assert handed == [0]
    assert r.xpending(KEYS.prefill_stream, KEYS.prefill_group)["pending"] == 1
    # Every choice had its first token out before the death (choice 0 from its own step,
    # choices 1 and 2 from the step after, which computed only the prompt's last block).
    assert [len(_events(r, c)) for c in job.choice_ids()] == [1, 1, 1]
    b = _worker(redis_url, "xpu-b", {"prefill"}, "xpu")
    decoder = _worker(redis_url, "cpu0", {"decode"}, "cpu")
    stop, threads = _serve([b, decoder])
    try:
        assert wait_for(lambda: _finished(r, job), 15)
        assert wait_for(lambda: r.xlen(KEYS.prefill_stream) == 0, 5)
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    first, *others = _check_outputs(r, job)
    assert [e.worker for e in first] == ["xpu-a"] + ["cpu0"] * (MAX_TOKENS - 1)
    for evs in others:  # resumed by b from the token a delivered, then handed off
        assert [e.worker for e in evs] == ["xpu-a", "xpu-b"] + ["cpu0"] * (MAX_TOKENS - 2)
    assert handed == [0, 1, 2], "choice 0 handed off once, by the worker that died"
    assert r.xlen(KEYS.decode_stream("cpu")) + r.xlen(KEYS.decode_stream("xpu")) == 0
    assert KVStore(r).stats() == (0, 0)


def test_cancelled_choices_are_not_served(redis_url):
    r = redis.Redis.from_url(redis_url)
    job = _queue(r, 3)
    cancelled = job.choice_ids()[1]
    r.set(KEYS.cancel_flag(cancelled), 1)
    worker = _worker(redis_url, "xpu", {"prefill", "decode"}, "xpu")
    stop, threads = _serve([worker])
    try:
        done = [job.choice_ids()[0], job.choice_ids()[2]]
        assert wait_for(lambda: all(_events(r, c)[-1:] and _events(r, c)[-1].finish_reason for c in done), 10)  # fmt: skip
        assert wait_for(lambda: r.xlen(KEYS.prefill_stream) == 0, 5)
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    assert _events(r, cancelled) == []
    assert worker.engine.num_running + worker.engine.num_waiting == 0
