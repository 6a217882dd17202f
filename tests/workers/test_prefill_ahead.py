"""An xPU worker whose decode slots are all busy prefills a waiting prompt in its handoff slot
when the dispatcher would send a decode to the CPU now (`Handoff.prefill_ahead`): the CPU's
free slots are filled without waiting for an xPU decode slot (which, saturated, they used to:
bench/hetero.py's CPU emptied to 0 of 8 streams with 18-25 prompts waiting on the xPU)."""

from __future__ import annotations

import time

import pytest
import redis
from syshax.broker.dispatcher import DeviceLoad, Dispatcher
from syshax.broker.keys import KEYS
from syshax.broker.schemas import DecodeJob, PrefillJob
from syshax.shared.sampling import SamplingParams
from syshax.workers.echo_engine import EchoEngine
from syshax.workers.worker import Worker, WorkerOptions


def _cpu_heartbeat(r: redis.Redis, running: int, capacity: int = 4) -> None:
    """A live CPU decode worker (its heartbeat alone), fast enough for the SLO."""
    r.hset(KEYS.worker("cpu0"), mapping={"id": "cpu0", "roles": "decode", "device_class": "cpu", "capacity": str(capacity), "running": str(running), "waiting": "0", "step_base_ms": "5", "step_row_ms": "1", "last_seen": str(time.time())})  # fmt: skip
    r.sadd(KEYS.workers, "cpu0")


def _prompt(r: redis.Redis, rid: str, tokens: int = 50) -> None:
    params = SamplingParams(max_tokens=tokens, temperature=0.0).to_dict()
    job = PrefillJob(request_id=rid, prompt_ids=[5, 6, 7], params=params, created=time.time(), deadline=time.time() + 60)  # fmt: skip
    r.xadd(KEYS.prefill_stream, {"j": job.pack()})


def _take(w: Worker) -> list:
    """The worker's next read, past its rate limits (the 5 ms poll, handoff.LOAD_CHECK_S)."""
    w.poll._last_poll = w.handoff.loads_checked_at = 0.0
    return w._take(w.free_slots(), idle=False)


@pytest.fixture
def xpu(redis_url):
    """An xPU worker with 2 decode slots and 1 handoff slot, both decode slots busy."""
    opts = WorkerOptions(worker_id="xpu", roles=frozenset({"prefill", "decode"}), device_class="xpu", handoff_slots=1, kv_store="redis")  # fmt: skip
    w = Worker(EchoEngine(max_num_seqs=3), redis.Redis.from_url(redis_url), opts, Dispatcher(slo_itl_s=0.05))  # fmt: skip
    for rid in ("a", "b"):
        _prompt(w.r, rid)
        for entry in w._take(w.free_slots(), idle=True):
            w.accept(entry)
    w._step()  # both prefilled, kept here (the xPU had room): the decode slots are full
    assert w.engine.num_running == 2 and w.free_slots() == 0
    assert w.load_fields()["capacity"] == 2, "the heartbeat's capacity is the decode slots"
    return w


def test_a_full_xpu_prefills_a_prompt_for_a_cpu_with_room(xpu):
    _cpu_heartbeat(xpu.r, running=0)
    xpu.farm.workers(force=True)
    _prompt(xpu.r, "c")
    taken = _take(xpu)
    assert [e.stream for e in taken] == [KEYS.prefill_stream]
    xpu.accept(taken[0])
    xpu._step()  # c's prefill, alongside a and b's decodes
    assert xpu.engine.num_running == 2, "c left the engine right after its prefill"
    jobs = xpu.r.xrange(KEYS.decode_stream("cpu"))
    assert [DecodeJob.unpack(f[b"j"]).request_id for _, f in jobs] == ["c"]
    assert [e.seq for e in xpu.publisher.delivered("c")] == [0], "its first token, from the xPU"
    xpu.publisher.flush_all()  # the dispatch record rides on the next token write
    log = xpu.r.lindex(KEYS.dispatch_log, 0).decode()
    assert " cpu [slo] CPU within the SLO" in log, log


def test_no_prompt_is_taken_while_the_cpu_is_full_or_twice_in_a_handoff_slot(xpu):
    _cpu_heartbeat(xpu.r, running=4)  # the CPU is full: the prompt waits for a slot
    xpu.farm.workers(force=True)
    _prompt(xpu.r, "d")
    _prompt(xpu.r, "e")
    assert _take(xpu) == []
    _cpu_heartbeat(xpu.r, running=0)
    xpu.farm.workers(force=True)
    (entry,) = _take(xpu)
    xpu.accept(entry)
    assert _take(xpu) == [], "one handoff slot, one prompt"
    pending = xpu.r.xpending(KEYS.prefill_stream, KEYS.prefill_group)["pending"]
    assert (xpu.r.xlen(KEYS.prefill_stream), pending) == (4, 3), "a, b, d read; e waits"


def test_offloads_next_is_the_dispatchers_own_answer():
    slo = Dispatcher(slo_itl_s=0.05)
    full_xpu = DeviceLoad(workers=1, capacity=2, running=2, step_model=(0.005, 0.001))
    fast_cpu = DeviceLoad(workers=1, capacity=4, running=1, step_model=(0.01, 0.005))
    assert slo.offloads_next(full_xpu, fast_cpu)
    slow_cpu = DeviceLoad(workers=1, capacity=4, running=1, step_model=(0.04, 0.01))
    assert not slo.offloads_next(full_xpu, slow_cpu), "over the SLO with one more"
    room_xpu = DeviceLoad(workers=1, capacity=2, running=1, step_model=(0.005, 0.001))
    assert not slo.offloads_next(room_xpu, fast_cpu), "the xPU first"
    assert not Dispatcher(decode_device="xpu").offloads_next(full_xpu, fast_cpu)
    assert not slo.offloads_next(full_xpu, DeviceLoad()), "no CPU decoder"
    assert slo.history == [], "a question, not a decision: nothing recorded"


def test_only_an_accelerator_in_an_offloading_farm_gets_a_handoff_slot():
    from syshax.shared.config import load_config
    from syshax.workers.worker_defaults import handoff_slots

    cfg = load_config(None)
    both = frozenset({"prefill", "decode"})
    assert handoff_slots(cfg, "emulated", "xpu", "cpu", both) == 1
    assert handoff_slots(cfg, "native", "xpu", "cuda", both) == 1
    assert handoff_slots(cfg, "native", "xpu", "cpu", both) == 0, "the xPU role on the CPU"
    assert handoff_slots(cfg, "native", "cpu", "cpu", frozenset({"decode"})) == 0
    assert handoff_slots(cfg, "emulated", "xpu", "cpu", frozenset({"prefill"})) == 0
    cfg.decode_device = "xpu"
    assert handoff_slots(cfg, "emulated", "xpu", "cpu", both) == 0, "nothing to offload"
