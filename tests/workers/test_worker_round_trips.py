"""A request's Redis work on a worker that prefills and decodes it: beyond the job read and
the token writes, nothing of its own. Its cancel check is answered by the cancels the worker
heard (cancel_watch.py), its dispatch decision needs no load read in a farm with one decoder
class (Dispatcher.settled), and its dispatch record and its ack ride on its token writes
(TokenPublisher.ride): the ack on the write with its last event."""

from __future__ import annotations

import time

import redis
from syshax.broker.dispatcher import Dispatcher
from syshax.broker.keys import KEYS
from syshax.broker.schemas import PrefillJob, TokenEvent
from syshax.shared.sampling import SamplingParams
from syshax.workers.echo_engine import EchoEngine
from syshax.workers.worker import Worker, WorkerOptions

from ..conftest import wait_for


def _calls(r: redis.Redis) -> dict[str, int]:
    return {k[8:]: int(v["calls"]) for k, v in r.info("commandstats").items()}


def _submit(r: redis.Redis, rid: str, max_tokens: int = 3) -> None:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0).to_dict()
    job = PrefillJob(request_id=rid, prompt_ids=[5, 6, 7], params=params, gateway="g")
    r.xadd(KEYS.prefill_stream, {"j": job.pack()})


def _worker(redis_url: str) -> Worker:
    opts = WorkerOptions(worker_id="cpu0", roles=frozenset({"prefill", "decode"}), device_class="cpu")  # fmt: skip
    w = Worker(EchoEngine(max_num_seqs=4), redis.Redis.from_url(redis_url), opts, Dispatcher())
    # The cancel subscription confirmed (the loop would see it on its first poll).
    line = f"{int(time.time() * 1000) + 60_000}-0"
    assert wait_for(lambda: w.cancels.covers(line), 5)
    time.sleep(0.005)
    return w


def _run(w: Worker) -> None:
    for _ in range(50):
        w.iterate()
        if not w.jobs and not w.engine.has_unfinished():
            return
    raise AssertionError("the request did not finish")


def test_a_request_costs_no_round_trip_of_its_own(redis_url):
    r = redis.Redis.from_url(redis_url)
    w = _worker(redis_url)
    _submit(r, "a")
    r.config_resetstat()
    _run(w)
    calls = _calls(r)
    events = w.publisher.delivered("a", "g")
    assert [e.seq for e in events] == [0, 1, 2] and events[-1].finish_reason == "length"
    assert r.xlen(KEYS.prefill_stream) == 0, "acked and deleted"
    assert r.xpending(KEYS.prefill_stream, KEYS.prefill_group)["pending"] == 0
    assert r.lindex(KEYS.dispatch_log, 0).decode().endswith("[no_xpu_decoder] no xPU decode worker")
    assert int(r.get(KEYS.dispatch_count("cpu"))) == 1
    # No cancel flag read, no queue lengths read, no MULTI for the ack.
    assert calls.get("exists", 0) == 0 and calls.get("xlen", 0) == 0, calls
    assert calls.get("exec", 0) == 0, calls


def test_the_ack_goes_with_the_last_event(redis_url, monkeypatch):
    """The ack is on the write that carries the request's end, after it: whoever sees the
    end sees the entry acked, and a worker dying before that write leaves both undone."""
    r = redis.Redis.from_url(redis_url)
    w = _worker(redis_url)
    _submit(r, "b", max_tokens=2)
    writes: list[list[str]] = []
    execute = w.publisher.r.pipeline

    def pipeline(*args, **kwargs):
        pipe = execute(*args, **kwargs)
        run = pipe.execute

        def recorded(*a, **kw):
            writes.append([str(c[0][0]).upper() for c in pipe.command_stack])
            return run(*a, **kw)

        pipe.execute = recorded
        return pipe

    monkeypatch.setattr(w.publisher.r, "pipeline", pipeline)
    _run(w)
    last = next(cmds for cmds in reversed(writes) if "XACK" in cmds)
    assert last.index("XADD") < last.index("XDEL") < last.index("XACK"), last
    ended = [c for c in writes if "XACK" in c]
    assert len(ended) == 1
    record = [TokenEvent.unpack(f[b"e"]) for _, f in r.xrange(KEYS.output_stream("b")) if b"e" in f]
    assert record and record[-1].finish_reason == "length"


def test_a_cancel_heard_before_the_job_is_taken_stops_it(redis_url):
    r = redis.Redis.from_url(redis_url)
    w = _worker(redis_url)
    _submit(r, "c", max_tokens=50)
    r.set(KEYS.cancel_flag("c"), 1, ex=60)  # the gateway's cancel: flag and publish
    r.publish(KEYS.cancel_channel, "c")
    r.config_resetstat()
    w.iterate()
    assert "c" not in w.jobs and not w.engine.has_unfinished(), "cancelled before it ran"
    assert _calls(r).get("exists", 0) == 0, "known from the cancel heard"
    assert wait_for(lambda: (w.iterate(), r.xlen(KEYS.prefill_stream) == 0)[1], 5)


def test_a_claim_round_with_nothing_to_claim_is_seven_round_trips(redis_url, monkeypatch):
    """A claim round that falls between two tokens of a stream is that gap's, every claim
    period (docs/benchmarks.md, "The worker loop at one stream"). With nothing to take: the
    live workers (2), the other class's stranded jobs (2: this farm has no xPU decoder), and
    one pipeline each for the dead workers' entries and for ours Redis may have lost on this
    worker's three streams and on the stranded one (3). It was 11: one XPENDING per stream."""
    from redis.connection import Connection

    w = _worker(redis_url)
    w.upkeep.start()
    sent = []
    send = Connection.send_packed_command

    def counted(self, command, check_health=True):
        sent.append(command)
        return send(self, command, check_health)

    monkeypatch.setattr(Connection, "send_packed_command", counted)
    w.upkeep.claim()
    monkeypatch.undo()
    assert len(sent) == 7, len(sent)
    assert w.upkeep.waiting == 0
