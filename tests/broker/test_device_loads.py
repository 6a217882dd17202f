"""The dispatcher's input from live heartbeats and the decode streams (a real Redis)."""

from __future__ import annotations

import time

import pytest
from syshax.broker.keys import KEYS
from syshax.broker.worker_io import device_loads


def _worker(cls: str, **fields: str) -> dict[str, str]:
    base = {"roles": "decode", "device_class": cls, "capacity": "8", "running": "1", "waiting": "0"}
    return base | fields


def test_step_models_and_tails_take_the_slowest_worker(r):
    workers = [
        _worker("cpu", step_base_ms="20", step_row_ms="10", step_tail="1.2"),
        _worker("cpu", step_base_ms="30", step_row_ms="10", step_tail="1.8"),
        _worker("xpu", step_base_ms="5", step_row_ms="0.1"),  # an older worker: no tail field
        _worker("cpu", roles="prefill"),  # not a decoder: not counted
    ]
    loads = device_loads(r, workers, KEYS)
    cpu, xpu = loads["cpu"], loads["xpu"]
    assert (cpu.workers, cpu.capacity, cpu.running) == (2, 16, 2)
    assert cpu.step_model == pytest.approx((0.030, 0.010)) and cpu.step_tail == 1.8
    assert xpu.step_model == pytest.approx((0.005, 0.0001)) and xpu.step_tail == 1.0


def test_prompts_waiting_for_a_prefill_count_on_the_prefilling_class(r):
    r.xgroup_create(KEYS.prefill_stream, KEYS.prefill_group, id="0", mkstream=True)
    for i in range(3):
        r.xadd(KEYS.prefill_stream, {"n": i})
    r.xreadgroup(KEYS.prefill_group, "xpu", {KEYS.prefill_stream: ">"}, count=1)  # one taken
    workers = [_worker("xpu", roles="prefill,decode"), _worker("cpu")]
    loads = device_loads(r, workers, KEYS)
    assert loads["xpu"].queued == 2, "two prompts wait for an xPU slot"
    assert loads["cpu"].queued == 0


def test_the_gateways_delivered_tail_raises_the_predicted_tail(r):
    from syshax.broker import itl_tails

    workers = [_worker("cpu", step_base_ms="20", step_row_ms="10", step_tail="1.2")]
    r.hset(KEYS.itl_tails, "cpu:gw", itl_tails.pack(2.0, 400, time.time()))
    cpu = device_loads(r, workers, KEYS)["cpu"]
    assert cpu.delivered_tail == 2.0 and cpu.step_tail == 1.2
    assert cpu.predicted_itl(tail=True) == pytest.approx(2.0 * 0.040)  # 2 streams: 20 + 20 ms
    assert cpu.predicted_itl() == pytest.approx(0.040)
    r.hset(KEYS.itl_tails, "cpu:gw", itl_tails.pack(2.0, 400, time.time() - 60))  # stopped
    assert device_loads(r, workers, KEYS)["cpu"].delivered_tail == 1.0
