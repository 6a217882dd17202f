"""A decode job queued for a device class with no live decoder is not left there.

A prefill worker hands off to the xpu stream when no CPU decoder looks alive (its heartbeat
was late, or it was restarting). Until this was fixed, a CPU decoder that came back never
looked at that stream, and the request hung until request_timeout. Now a decoder takes the
other class's decode jobs while that class has nobody decoding.
"""

from __future__ import annotations

import threading
import time
import uuid

import redis
from syshax.broker.keys import KEYS
from syshax.broker.kv_store import KVStore
from syshax.broker.schemas import PrefillJob, TokenEvent, entry_events
from syshax.shared.sampling import SamplingParams

from ..conftest import wait_for
from .echo_workers import echo_worker


def _events(r: redis.Redis, rid: str) -> list[TokenEvent]:
    return [ev for _, f in r.xrange(KEYS.output_stream(rid)) for ev in entry_events(f)]


def test_a_cpu_decoder_takes_jobs_queued_for_an_xpu_class_with_no_decoder(redis_url):
    r = redis.Redis.from_url(redis_url)
    stop = threading.Event()
    prefill = echo_worker(redis_url, "xpu", {"prefill"}, "xpu")
    threads = [threading.Thread(target=prefill.serve, args=(stop, 2.0), daemon=True)]
    threads[0].start()
    rid = uuid.uuid4().hex
    params = SamplingParams(max_tokens=8, temperature=0.0).to_dict()
    job = PrefillJob(request_id=rid, prompt_ids=list(range(20, 40)), params=params)
    r.xadd(KEYS.prefill_stream, {"j": job.pack()})
    try:
        # No decoder anywhere: the prefill worker publishes the first token and queues the
        # rest on the xpu stream, where (with this topology) nobody ever decodes.
        assert wait_for(lambda: r.xlen(KEYS.decode_stream("xpu")) == 1, 10)
        assert [e.seq for e in _events(r, rid)] == [0]
        # (the dispatch record rides on the worker's next write: within RIDE_MAX_S)
        assert wait_for(lambda: r.lindex(KEYS.dispatch_log, 0) is not None, 5)
        assert r.lindex(KEYS.dispatch_log, 0).decode().endswith("no CPU decode worker")
        decoder = echo_worker(redis_url, "cpu0", {"decode"}, "cpu")
        threads.append(threading.Thread(target=decoder.serve, args=(stop, 2.0), daemon=True))
        threads[1].start()
        assert wait_for(lambda: (_events(r, rid) or [None])[-1].finish_reason is not None, 10)
        evs = _events(r, rid)
        assert [e.seq for e in evs] == list(range(8)), "every token once, in order"
        assert [e.token_id for e in evs] == list(range(20, 28))
        assert [e.worker for e in evs] == ["xpu"] + ["cpu0"] * 7
        assert evs[-1].finish_reason == "length"
        assert wait_for(lambda: r.xlen(KEYS.decode_stream("xpu")) == 0, 10), "acked and deleted"
        assert KVStore(r).stats() == (0, 0), "the KV lease was taken and freed"
    finally:
        stop.set()
        for t in threads:
            t.join(10)


def test_a_decoder_leaves_the_other_class_alone_while_it_has_a_live_decoder(redis_url):
    r = redis.Redis.from_url(redis_url)
    stop = threading.Event()
    # A xpu decoder that is registered and alive but not stepping this stream's jobs
    # (its loop is not running): its heartbeat alone must keep the CPU decoder out.
    xpu = echo_worker(redis_url, "gpu0", {"decode"}, "xpu")
    xpu.heartbeat.beat(**xpu.load_fields())
    cpu = echo_worker(redis_url, "cpu0", {"decode"}, "cpu")
    thread = threading.Thread(target=cpu.serve, args=(stop, 2.0), daemon=True)
    thread.start()
    try:
        r.xadd(KEYS.decode_stream("xpu"), {"j": b"not a job"})
        time.sleep(1.0)  # five claim rounds of the CPU decoder
        assert r.xlen(KEYS.dead_letter_stream) == 0, "the CPU decoder never read it"
        assert r.xlen(KEYS.decode_stream("xpu")) == 1
    finally:
        stop.set()
        thread.join(10)


def test_a_job_redis_gave_to_a_dead_connection_with_our_id_is_taken_back(redis_url, caplog):
    """The same-id restart stall, made deterministic. Redis records a stream entry as pending
    under a consumer when it serves that consumer's blocked XREADGROUP, before it writes the
    reply. A connection with our worker id that is dead but not yet closed (a killed process
    being torn down; a connection the network cut, kept by the server until TCP gives up) is
    served like a live one: the job is pending under our id, which heartbeats, so nobody
    claims it, and the take-back at start has already run. The worker must find it itself."""
    r = redis.Redis.from_url(redis_url)
    stop = threading.Event()
    decoder = echo_worker(redis_url, "cpu0", {"decode"}, "cpu")
    prefill = echo_worker(redis_url, "xpu", {"prefill"}, "xpu")
    threads = [threading.Thread(target=w.serve, args=(stop, 2.0), daemon=True) for w in (decoder, prefill)]  # fmt: skip
    threads[0].start()
    ghost = redis.Redis.from_url(redis_url).connection_pool.get_connection("XREADGROUP")
    try:
        assert wait_for(lambda: r.exists(KEYS.worker("cpu0")), 10)
        # The dead connection: blocked on the decode stream under our id, never read again.
        stream = KEYS.decode_stream("cpu")
        ghost.send_command("XREADGROUP", "GROUP", KEYS.prefill_group, "cpu0", "BLOCK", 0, "COUNT", 1, "STREAMS", stream, ">")  # fmt: skip
        # The live loop re-blocks every 20 ms, behind the ghost: the ghost is served first.
        time.sleep(0.2)
        caplog.set_level("WARNING", logger="syshax.workers.upkeep")
        threads[1].start()
        rid = uuid.uuid4().hex
        params = SamplingParams(max_tokens=8, temperature=0.0).to_dict()
        job = PrefillJob(request_id=rid, prompt_ids=list(range(20, 40)), params=params)
        r.xadd(KEYS.prefill_stream, {"j": job.pack()})
        assert wait_for(lambda: [e.finish_reason for e in _events(r, rid)][-1:] == ["length"], 15)
        evs = _events(r, rid)
        assert [e.seq for e in evs] == list(range(8)), "every token once, in order"
        assert [e.token_id for e in evs] == list(range(20, 28))
        assert [e.worker for e in evs] == ["xpu"] + ["cpu0"] * 7
        assert "pending under our id but never received" in caplog.text, "the ghost had it"
        assert wait_for(lambda: r.xlen(stream) == 0, 10), "acked and deleted"
        assert KVStore(r).stats() == (0, 0), "the KV lease was taken and freed"
    finally:
        stop.set()
        for t in threads:
            t.join(10)
        ghost.disconnect()
