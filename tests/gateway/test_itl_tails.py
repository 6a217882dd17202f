"""The gateway's delivered inter-token latency tails (gateway/itl_tails.py), published per
device class for the dispatcher's SLO rule (broker/itl_tails.py)."""

from __future__ import annotations

import time

import pytest
from syshax.broker import itl_tails
from syshax.gateway.itl_tails import ItlTails

from ..conftest import wait_for


def test_the_tail_is_p99_over_p50_per_class_in_the_window():
    t = ItlTails(window_s=10.0, min_gaps=100)
    for i in range(99):  # the CPU worker: 20 ms, and one gap in a hundred at 80 ms
        t.add("cpu0", 0.020, now=100.0 + i * 0.02)
    t.add("cpu0", 0.080, now=102.0)
    for i in range(300):
        t.add("xpu", 0.010, now=100.0 + i * 0.01)
    t.add("gone", 1.0, now=102.0)  # no live heartbeat: forgotten
    tails = t.tails({"cpu0": "cpu", "xpu": "xpu"}, now=102.0)
    assert tails["cpu"] == (pytest.approx(4.0), 100) and tails["xpu"] == (1.0, 300)
    assert "gone" not in t._gaps
    assert t.tails({"cpu0": "cpu"}, now=150.0) == {}, "older than the window: nothing to say"
    t.add("cpu0", 0.02, now=150.0)
    assert "cpu" not in t.tails({"cpu0": "cpu"}, now=150.0), "fewer than min_gaps"


def test_the_dispatcher_reads_only_fresh_well_formed_entries():
    now = 1000.0
    fields = {
        b"cpu:gw1": itl_tails.pack(1.8, 500, now - 1).encode(),
        b"cpu:gw2": itl_tails.pack(2.5, 300, now - 2).encode(),  # the worst gateway counts
        b"xpu:gw1": itl_tails.pack(3.0, 900, now - itl_tails.MAX_AGE_S - 1).encode(),  # stale
        b"xpu:gw3": b"garbage",
    }
    assert itl_tails.fresh(fields, now) == {"cpu": 2.5}


def test_a_gateway_publishes_the_tails_of_the_tokens_it_delivered(thread_farm):
    f = thread_farm(workers="echo", step_delay=0.003, detokenize=True)
    f.app.state.gateway.metrics.itl_tails.min_gaps = 20
    out = list(f.client().completions.create(model=f.model, prompt="one two three " * 20, max_tokens=40, stream=True))  # fmt: skip
    assert sum(bool(c.choices and c.choices[0].text) for c in out) >= 30
    assert wait_for(lambda: f.r.hgetall(f.keys.itl_tails), timeout=5), "published within seconds"
    fields = {k.decode(): v.decode().split() for k, v in f.r.hgetall(f.keys.itl_tails).items()}
    (key, (ratio, gaps, at)), *_ = fields.items()
    assert key.split(":")[0] in ("xpu", "cpu") and float(ratio) >= 1.0 and int(gaps) >= 20
    assert abs(float(at) - time.time()) < 5
    assert 0 < f.r.pttl(f.keys.itl_tails) <= itl_tails.TTL_MS
