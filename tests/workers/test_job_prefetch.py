"""The worker's poll for new jobs goes with the step's token write while streams decode
(workers/job_poll.py), and on a thread during a step that writes nothing (a prompt-only step:
workers/job_prefetch.py): a job queued while a stream decodes is read by that poll, accepted at
the schedule after it, and nothing is read twice or lost; a draining worker puts back what
either read got."""

from __future__ import annotations

import time

import redis
from syshax.broker.dispatcher import Dispatcher
from syshax.broker.farm_io import queue_jobs
from syshax.broker.keys import KEYS
from syshax.broker.schemas import PrefillJob
from syshax.shared.sampling import SamplingParams
from syshax.workers.echo_engine import EchoEngine
from syshax.workers.job_poll import POLL_INTERVAL_S
from syshax.workers.worker import Worker, WorkerOptions


def _submit(r: redis.Redis, rid: str, tokens: int) -> None:
    params = SamplingParams(max_tokens=tokens, temperature=0.0).to_dict()
    now = time.time()
    job = PrefillJob(request_id=rid, prompt_ids=[5, 6, 7], params=params, created=now, deadline=now + 60)  # fmt: skip
    queue_jobs(r, KEYS.prefill_stream, [job])


def _worker(redis_url: str) -> Worker:
    opts = WorkerOptions(worker_id="w0", roles=frozenset({"prefill", "decode"}), device_class="cpu")  # fmt: skip
    return Worker(EchoEngine(max_num_seqs=4), redis.Redis.from_url(redis_url), opts, Dispatcher())  # fmt: skip


def _pending(r: redis.Redis) -> int:
    return r.xpending(KEYS.prefill_stream, KEYS.prefill_group)["pending"]


def test_a_job_queued_mid_stream_is_read_with_the_step_s_write_and_started_after_it(redis_url):
    r = redis.Redis.from_url(redis_url)
    w = _worker(redis_url)
    _submit(r, "a", 16)
    w.iterate()  # idle: the blocking read takes "a", whose prefill runs
    assert "a" in w.jobs and w.engine.num_running == 1
    assert not w.prefetch.collect(), "a poll sent with the prefill (a slow host) found nothing"
    _submit(r, "b", 4)
    time.sleep(POLL_INTERVAL_S)
    direct = w.streams.work.read

    def no_direct_read(*args, **kwargs):
        raise AssertionError("a read of its own while a stream decodes")

    w.streams.work.read = no_direct_read
    w.iterate()  # "b" is read by the poll on this step's token write...
    assert "b" not in w.jobs and not w.prefetch.in_flight
    assert _pending(r) == 2, "read: pending under this worker, as a direct read leaves it"
    w.iterate()  # ...and accepted at the next schedule, where the direct read was
    assert "b" in w.jobs
    w.streams.work.read = direct
    while w.engine.has_unfinished():
        w.iterate()
    for rid, n in (("a", 16), ("b", 4)):
        events = w.publisher.delivered(rid)
        assert [e.seq for e in events] == list(range(n)), rid
    assert _pending(r) == 0 and r.xlen(KEYS.prefill_stream) == 0, "each acked once"


def _drained_back(r: redis.Redis, w: Worker, redis_url: str, a_tokens: int) -> None:
    """Drain `w`, which runs "a" and has read "b" without taking it: "a" finishes, "b" is back
    on its stream, unread, for another worker, and nothing is left pending."""
    w.drain(timeout=5)
    assert "b" not in w.jobs and w.publisher.delivered("b") == []
    assert [e.seq for e in w.publisher.delivered("a")] == list(range(a_tokens))
    assert _pending(r) == 0
    other = _worker(redis_url)
    taken = other._take(other.free_slots(), idle=True)
    assert len(taken) == 1 and PrefillJob.unpack(taken[0].data).request_id == "b"


def _a_running_b_queued(redis_url: str, a_tokens: int) -> tuple[redis.Redis, Worker]:
    """A worker running "a" (its prefill's poll found nothing), with "b" queued since and its
    next poll due."""
    r = redis.Redis.from_url(redis_url)
    w = _worker(redis_url)
    _submit(r, "a", a_tokens)
    w.iterate()
    assert not w.prefetch.collect()
    _submit(r, "b", 4)
    time.sleep(POLL_INTERVAL_S)
    return r, w


def test_a_draining_worker_puts_back_what_the_step_s_read_got(redis_url):
    r, w = _a_running_b_queued(redis_url, a_tokens=4)
    w.poll.before_step(w.free_slots(), will_write=False)  # a step that writes nothing
    assert w.prefetch.in_flight
    deadline = time.monotonic() + 5
    while _pending(r) < 2 and time.monotonic() < deadline:  # "b" read, not yet taken
        time.sleep(0.01)
    _drained_back(r, w, redis_url, a_tokens=4)


def test_a_draining_worker_puts_back_what_the_write_s_poll_got(redis_url):
    r, w = _a_running_b_queued(redis_url, a_tokens=8)
    w._schedule()
    w._prefetch_jobs()
    w._step()  # the poll rides on this step's write: "b" read, not yet taken
    assert _pending(r) == 2 and "b" not in w.jobs
    _drained_back(r, w, redis_url, a_tokens=8)
