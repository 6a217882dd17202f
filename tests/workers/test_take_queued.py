"""Under the SLO rule a decode that neither class had room for waits on the xPU's stream; a CPU
worker whose slot frees up takes it from there while the xPU is still full and the CPU keeps
the SLO with one more stream (`Dispatcher.take_queued`), so the queue drains into whichever
class frees a slot first."""

from __future__ import annotations

import time

import redis
from syshax.broker.dispatcher import Dispatcher
from syshax.broker.keys import KEYS
from syshax.broker.schemas import DecodeJob
from syshax.shared.sampling import SamplingParams
from syshax.workers.echo_engine import EchoEngine
from syshax.workers.worker import Worker, WorkerOptions


def _xpu_heartbeat(r: redis.Redis, running: int) -> None:
    """A live xPU decode worker with 2 slots and `running` streams (its heartbeat alone)."""
    r.hset(KEYS.worker("xpu"), mapping={"id": "xpu", "roles": "decode,prefill", "device_class": "xpu", "capacity": "2", "running": str(running), "waiting": "0", "last_seen": str(time.time())})  # fmt: skip
    r.sadd(KEYS.workers, "xpu")


def _queue_on_the_xpu(r: redis.Redis, rid: str) -> None:
    params = SamplingParams(max_tokens=4, temperature=0.0).to_dict()
    job = DecodeJob(request_id=rid, prompt_ids=[5, 6, 7], output_ids=[5], params=params)
    r.xadd(KEYS.decode_stream("xpu"), {"j": job.pack()})


def test_a_cpu_worker_takes_a_decode_queued_on_the_full_xpu(redis_url):
    r = redis.Redis.from_url(redis_url)
    opts = WorkerOptions(worker_id="cpu0", roles=frozenset({"decode"}), device_class="cpu")
    cpu = Worker(EchoEngine(max_num_seqs=4), redis.Redis.from_url(redis_url), opts, Dispatcher(slo_itl_s=0.05))  # fmt: skip
    cpu.heartbeat.beat(**cpu.load_fields())
    _xpu_heartbeat(r, running=1)
    _queue_on_the_xpu(r, "a")
    # The xPU has a free slot for the job that waits: the CPU leaves it to the xPU.
    assert cpu._take(cpu.free_slots(), idle=False) == []
    _xpu_heartbeat(r, running=2)  # full: the job waits for a slot there
    time.sleep(0.3)  # the worker's view of its peers is cached for 0.25 s
    taken = cpu._take(cpu.free_slots(), idle=False)
    assert [e.stream for e in taken] == [KEYS.decode_stream("xpu")]
    cpu.accept(taken[0])
    cpu._start_backlog()
    while cpu.engine.has_unfinished():
        cpu._step()
    events = cpu.publisher.delivered("a")
    assert [e.seq for e in events] == [1, 2, 3] and {e.worker for e in events} == {"cpu0"}
    assert events[-1].finish_reason == "length"
    assert r.xlen(KEYS.decode_stream("xpu")) == 0, "acked and deleted on the xPU's stream"
    log = r.lindex(KEYS.dispatch_log, 0).decode()
    assert " cpu [slo_take] taken from the full xPU's queue (3/2)" in log, log
    # Without the SLO rule the queue is the xPU's alone.
    plain = Worker(EchoEngine(max_num_seqs=4), redis.Redis.from_url(redis_url), WorkerOptions(worker_id="cpu1", roles=frozenset({"decode"}), device_class="cpu"), Dispatcher())  # fmt: skip
    _queue_on_the_xpu(r, "b")
    assert plain._take(plain.free_slots(), idle=False) == []
