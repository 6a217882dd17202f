"""`Handoff.decide`: the load a worker gives the dispatcher for a sequence it just prefilled."""

from __future__ import annotations

from types import SimpleNamespace

import fakeredis
import prometheus_client
from syshax.broker.dispatcher import CPU, XPU, DeviceLoad, Dispatcher
from syshax.broker.keys import KEYS
from syshax.shared.sampling import SamplingParams
from syshax.workers.farm_view import FarmView
from syshax.workers.handoff import Handoff


def _handoff(
    running: int, capacity: int, roles: set[str], dispatcher: Dispatcher, peers, cls: str = "xpu"
):
    """The handoff of an xPU (or `cls`) worker with `running` of its `capacity` slots held,
    which sees `peers` as the farm's other live workers."""
    counter = prometheus_client.Counter("d", "d", ["device", "rule"], registry=None)
    me = {
        "roles": ",".join(sorted(roles)), "device_class": cls, "capacity": capacity,
        "running": running, "waiting": 0, "step_base_ms": 2.0, "step_row_ms": 0.1,
    }  # fmt: skip
    r = fakeredis.FakeRedis()
    farm = FarmView(r, KEYS, SimpleNamespace(static={"id": cls, "host": "h"}), lambda: me)
    farm.workers = lambda force=False: peers

    def ride(add) -> None:  # the token write a dispatch record rides on, sent at once here
        pipe = r.pipeline(transaction=False)
        add(pipe)
        pipe.execute()

    return Handoff(
        SimpleNamespace(output_ids=lambda rid: [7], max_model_len=512),
        SimpleNamespace(
            worker_id=cls,
            device_class=cls,
            roles=frozenset(roles),
            handoff_slots=0,
            claim_s=2.0,
        ),
        dispatcher,
        r=r,
        keys=KEYS,
        streams=SimpleNamespace(),
        kv=SimpleNamespace(),
        farm=farm,
        metrics=SimpleNamespace(labels={}, dispatch=counter),
        ride=ride,
    )


CPU_PEER = {"id": "cpu0", "roles": "decode", "device_class": "cpu", "capacity": "8", "running": "0", "waiting": "0", "step_base_ms": "20", "step_row_ms": "10"}  # fmt: skip
JOB = SimpleNamespace(request_id="r1", params=SamplingParams(max_tokens=32))


def test_a_sequence_that_fills_its_own_worker_exactly_stays_there():
    """The sequence just prefilled already holds one of the xPU's 4 slots (running 4 counts
    it): keeping it needs no fifth slot, so the xPU is not "full" for it."""
    handoff = _handoff(4, 4, {"prefill", "decode"}, Dispatcher(slo_itl_s=0.050), [CPU_PEER])
    decision = handoff.decide(JOB)
    assert decision.device == XPU and decision.rule == "slo", decision


def test_one_more_than_the_slots_still_goes_elsewhere():
    handoff = _handoff(5, 4, {"prefill", "decode"}, Dispatcher(slo_itl_s=0.050), [CPU_PEER])
    assert handoff.decide(JOB).device == CPU


def test_a_prefill_only_worker_does_not_discount_a_class_it_is_not_in():
    xpu_decoder = {"id": "g2", "roles": "decode", "device_class": "xpu", "capacity": "4", "running": "4", "waiting": "0", "step_base_ms": "2", "step_row_ms": "0.1"}  # fmt: skip
    handoff = _handoff(1, 4, {"prefill"}, Dispatcher(slo_itl_s=0.050), [CPU_PEER, xpu_decoder])
    assert handoff.decide(JOB).device == CPU  # the xpu decoder is full: 4 of 4


def test_a_full_worker_with_prompts_waiting_hands_the_sequence_off():
    """Keeping the sequence would fill the xPU while prompts wait for its slots: the CPU takes
    it (within the SLO), so the xPU can take the next prompt."""
    handoff = _handoff(4, 4, {"prefill", "decode"}, Dispatcher(slo_itl_s=0.050), [CPU_PEER])
    handoff.r.xgroup_create(KEYS.prefill_stream, KEYS.prefill_group, id="0", mkstream=True)
    handoff.r.xadd(KEYS.prefill_stream, {"n": 1})
    decision = handoff.decide(JOB)
    assert decision.device == CPU and decision.rule == "slo", decision


def test_with_no_cpu_decoder_the_decision_reads_no_loads():
    """An xPU worker that decodes, in a farm with no live CPU decoder: every rule answers the
    xPU before it looks at a load, so `place` decides without reading the loads (the live
    workers come from the view, queue lengths are not read); the decision is recorded."""
    xpu_peer = {"id": "g2", "roles": "decode", "device_class": "xpu", "capacity": "4", "running": "4", "waiting": "0"}  # fmt: skip
    handoff = _handoff(1, 4, {"prefill", "decode"}, Dispatcher(slo_itl_s=0.050), [xpu_peer])
    handoff.farm.workers = lambda force=False, max_age=0.0: [xpu_peer]
    full_path = handoff.decide(JOB)  # what the dispatcher answers with the loads read
    handoff.r.delete(KEYS.dispatch_count(XPU))

    def no_loads():
        raise AssertionError("the loads were read")

    handoff.farm.loads = no_loads
    decision = handoff.without_loads(JOB)
    assert decision is not None and decision.device == XPU == full_path.device
    assert decision.rule == full_path.rule == "no_cpu_decoder", decision
    assert int(handoff.r.get(KEYS.dispatch_count(XPU))) == 1  # recorded as before


def test_a_live_cpu_decoder_sends_the_decision_to_the_loads():
    handoff = _handoff(1, 4, {"prefill", "decode"}, Dispatcher(slo_itl_s=0.050), [CPU_PEER])
    handoff.farm.workers = lambda force=False, max_age=0.0: [CPU_PEER]
    assert handoff.without_loads(JOB) is None


def test_a_prefill_only_worker_reads_the_loads_when_both_classes_decode():
    xpu_peer = {"id": "g2", "roles": "decode", "device_class": "xpu"}
    handoff = _handoff(1, 4, {"prefill"}, Dispatcher(slo_itl_s=0.050), [])
    handoff.farm.workers = lambda force=False, max_age=0.0: [xpu_peer, CPU_PEER]
    assert handoff.without_loads(JOB) is None
    handoff.farm.workers = lambda force=False, max_age=0.0: [CPU_PEER]  # no xPU decoder
    decision = handoff.without_loads(JOB)
    assert decision is not None and (decision.device, decision.rule) == (CPU, "no_xpu_decoder")


def test_a_cpu_worker_with_no_xpu_decoder_decides_without_the_loads():
    """A CPU worker that prefills and decodes, alone in its farm (no xPU decoder, as in a
    CPU-only farm): the decision is its own class, and no load is read; its heartbeat need
    not be in the view yet (it counts itself)."""
    handoff = _handoff(1, 4, {"prefill", "decode"}, Dispatcher(), [], cls="cpu")
    handoff.farm.workers = lambda force=False, max_age=0.0: []

    def no_loads():
        raise AssertionError("the loads were read")

    handoff.farm.loads = no_loads
    decision = handoff.without_loads(JOB)
    assert decision is not None and (decision.device, decision.rule) == (CPU, "no_xpu_decoder")
    assert int(handoff.r.get(KEYS.dispatch_count(CPU))) == 1
    job = SimpleNamespace(request_id="r2", params=SamplingParams(max_tokens=32))
    assert handoff.place(job) is False and job.in_process  # it stays in this engine


def test_with_every_decoder_restarting_the_job_goes_where_decoders_were_last_seen():
    """A prefill-only worker in a farm whose decoders are all CPU workers: while every one of
    them is restarting (none looks alive), the decode job is queued for the CPU class, where
    the next one to start reads it, not on the stream of an xPU class that has no decoder.
    A farm that never had a live decoder keeps the dispatcher's answer (the xPU's stream)."""
    handoff = _handoff(0, 4, {"prefill"}, Dispatcher(), [])
    live = [CPU_PEER]
    handoff.farm.workers = lambda force=False, max_age=0.0: live
    handoff.farm.loads = lambda: {"xpu": DeviceLoad(), "cpu": DeviceLoad()}
    never = _handoff(0, 4, {"prefill"}, Dispatcher(), [])
    never.farm.workers = lambda force=False, max_age=0.0: []
    assert never.without_loads(JOB).device == XPU  # nothing was ever seen decoding
    assert handoff.without_loads(JOB).device == CPU  # the CPU decoder is alive
    live.clear()  # ... and now restarting
    decision = handoff.without_loads(JOB)
    assert decision is not None and decision.device == CPU, decision
    assert decision.rule == "no_xpu_decoder", decision
