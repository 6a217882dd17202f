"""The capacity model behind `syshax plan` (workers/capacity_plan.py): pure arithmetic, checked
against hand-computed values."""

from __future__ import annotations

import pytest
from syshax.workers.accelerator_profiles import BUILTIN_PROFILES, ModelScale
from syshax.workers.capacity_plan import (
    CpuLayout,
    Prediction,
    StepCurve,
    Workload,
    XpuModel,
    best,
    layouts_for,
    predict,
)

from ..lightness import assert_loads_without

A10 = BUILTIN_PROFILES["a10"]
W = Workload(input_len=128, output_len=128)


def test_fit_recovers_a_line_and_clamps():
    curve = StepCurve.fit([(1, 0.005), (2, 0.007), (4, 0.011), (8, 0.019)], tail=1.4)
    assert curve.base_s == pytest.approx(0.003)
    assert curve.per_row_s == pytest.approx(0.002)
    assert curve.tail == 1.4
    assert StepCurve.fit([(4, 0.01)]).per_row_s == 0.0  # one point: flat
    assert StepCurve.fit([(1, 0.01), (2, 0.005)]).per_row_s == 0.0  # never a negative slope
    assert StepCurve.fit([(1, 0.01)], tail=0.5).tail == 1.0
    with pytest.raises(ValueError):
        StepCurve.fit([])


def test_streams_at_slo_keep_the_tail_within_it():
    layout = CpuLayout(2, 1, StepCurve(0.004, 0.002, tail=2.0), max_streams=8)
    # tail * (4 + 2r) ms <= 30 ms  ->  r <= 5.5
    assert layout.streams_at_slo(0.030) == 5
    assert layout.tokens_per_s(0.030) == pytest.approx(2 * 5 / 0.014)
    assert layout.streams_at_slo(None) == 8  # no SLO: the batch cap
    assert layout.streams_at_slo(0.010) == 0  # even one stream misses it
    assert layout.tokens_per_s(0.010) == 0.0


def test_xpu_rate_matches_the_closed_form():
    scale = ModelScale(weights=0.02, kv=0.2)
    xpu = XpuModel(A10, scale, slots=4, overhead_s=0.0005, overhead_per_row_s=0.0001)
    ctx = int(4 * W.mean_context)
    step = A10.step_seconds(0, 4, ctx, scale) + 0.0005 + 4 * 0.0001
    p = 0.02 * 128 / A10.prefill_tokens_per_s
    assert xpu.decode_step_s(W) == pytest.approx(step)
    assert xpu.prefill_s(W) == pytest.approx(p)
    k = 4 / step
    assert xpu.tokens_per_s(W) == pytest.approx(k / (1 + k * p / 128))
    # Prefilling the CPU's requests takes xPU time: its own rate drops.
    with_cpu = xpu.tokens_per_s(W, cpu_tps=500.0)
    assert with_cpu == pytest.approx(k * (1 - 500 * p / 128) / (1 + k * p / 128))
    assert with_cpu < xpu.tokens_per_s(W)


def test_predict_adds_the_cpu_and_respects_the_farm_cap():
    xpu = XpuModel(A10, 1.0, slots=16)  # the full 8B model on an A10: slow steps
    layout = CpuLayout(1, 8, StepCurve(0.020, 0.004), max_streams=8)
    alone = predict(xpu, W, None, slo_s=0.05)
    both = predict(xpu, W, layout, slo_s=0.05)
    assert alone.cpu_tps == 0 and alone.layout is None
    assert both.cpu_streams == 7  # 20 + 4r <= 50 -> r = 7
    assert both.cpu_itl_s == pytest.approx(0.048)
    assert both.total_tps > alone.total_tps
    capped = predict(xpu, W, layout, slo_s=0.05, farm_tps=both.total_tps / 2)
    assert capped.capped_by_farm
    assert capped.total_tps == pytest.approx(both.total_tps / 2)
    assert capped.cpu_tps / capped.xpu_tps == pytest.approx(both.cpu_tps / both.xpu_tps)


def test_best_prefers_more_tokens_then_fewer_workers():
    xpu = XpuModel(A10, 1.0, slots=16)
    curve = StepCurve(0.01, 0.002)
    alone = predict(xpu, W, None, 0.05)
    one, two = (predict(xpu, W, CpuLayout(n, 1, curve, 4), 0.05) for n in (1, 2))
    assert best([alone, one, two]) is two  # two workers of the same speed serve more
    # A layout that gets no stream within the SLO ties with the xPU alone: the xPU alone wins.
    none = predict(xpu, W, CpuLayout(3, 1, curve, 4), 0.005)
    assert none.cpu_streams == 0
    assert best([none, alone]) is alone
    # Within 2% (probe noise) the layout with fewer workers wins.
    a = Prediction(CpuLayout(1, 2, curve, 4), 1000.0, 100.0, 4, 0.01, 0.01, False)
    b = Prediction(CpuLayout(2, 1, curve, 4), 1000.0, 115.0, 8, 0.01, 0.01, False)
    assert best([b, a]) is a
    c = Prediction(CpuLayout(2, 1, curve, 4), 1000.0, 150.0, 8, 0.01, 0.01, False)
    assert best([a, c]) is c


def test_layouts_split_the_cores_evenly():
    assert layouts_for(2) == [(1, 2), (2, 1)]
    assert layouts_for(8) == [(1, 8), (2, 4), (4, 2), (8, 1)]
    assert layouts_for(1) == [(1, 1)]


def test_bad_workload_is_refused():
    with pytest.raises(ValueError):
        Workload(0, 128)
    with pytest.raises(ValueError):
        Workload(16, 1)


def test_the_model_and_the_plan_command_import_no_torch():
    assert_loads_without("import syshax.workers.capacity_plan, syshax.commands.plan", ("torch",))
