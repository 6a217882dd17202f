"""Dispatcher policy with an inter-token-latency SLO: the xPU first while it keeps the SLO, the
CPU only while its predicted latency with one more stream stays within it, the rest queues."""

import pytest
from syshax.broker.dispatcher import CPU, RULES, XPU, DeviceLoad, Dispatcher
from syshax.workers.engine.outputs import EngineStats, TokenCadence
from syshax.workers.upkeep import step_fields

# A CPU worker stepping n streams in 20 + 10 n ms; an xPU in 15 + 0.2 n ms.
CPU_STEPS = (0.020, 0.010)
XPU_STEPS = (0.015, 0.0002)


def slo(ms: float, **kw) -> Dispatcher:
    return Dispatcher(cpu_max_batch_size=8, slo_itl_s=ms / 1e3, **kw)


def test_predicted_itl_counts_the_new_stream_and_spreads_over_workers():
    cpu = DeviceLoad(workers=1, capacity=8, running=2, step_model=CPU_STEPS)
    assert abs(cpu.predicted_itl() - 0.050) < 1e-12  # 3 streams: 20 + 30 ms
    two = DeviceLoad(workers=2, capacity=16, running=4, queued=1, step_model=CPU_STEPS)
    assert abs(two.predicted_itl() - 0.050) < 1e-12  # 6 streams on 2 workers: 3 each
    assert DeviceLoad(workers=1, capacity=8).predicted_itl() is None


def test_the_xpu_takes_work_while_it_keeps_the_slo():
    d = slo(50)
    xpu = DeviceLoad(workers=1, capacity=64, running=10, step_model=XPU_STEPS)
    cpu = DeviceLoad(workers=1, capacity=8, running=0, step_model=CPU_STEPS)
    decision = d.choose(xpu, cpu, 100)
    assert decision.device == XPU and "xPU within the SLO" in decision.reason


def test_the_cpu_takes_overflow_only_within_the_slo():
    d = slo(50)
    xpu = DeviceLoad(workers=1, capacity=16, running=16, step_model=XPU_STEPS)  # full
    cpu = DeviceLoad(workers=1, capacity=8, running=2, step_model=CPU_STEPS)  # 50 ms with one more
    decision = d.choose(xpu, cpu, 100)
    assert decision.device == CPU and "CPU within the SLO (50 ms <= 50 ms)" in decision.reason
    cpu.running = 3  # 60 ms with one more: over the SLO although the CPU has room (8 slots)
    decision = d.choose(xpu, cpu, 100)
    assert decision.device == XPU and "queued on the xPU" in decision.reason


def test_a_burst_fills_the_cpu_exactly_up_to_the_slo():
    d = slo(50)
    xpu = DeviceLoad(workers=1, capacity=32, running=0, step_model=(0.030, 0.001))  # 50 ms at 20
    cpu = DeviceLoad(workers=1, capacity=8, running=0, step_model=CPU_STEPS)
    for _ in range(40):
        target = xpu if d.choose(xpu, cpu, 64).device == XPU else cpu
        target.queued += 1
    assert cpu.load == 3, "20 + 10 * 3 = 50 ms: a fourth stream would pass the SLO"
    assert xpu.load == 37, "20 within its SLO, then the rest queues on the xPU"


def test_an_unmeasured_cpu_is_trusted_with_one_stream_until_measured():
    d = slo(50)
    xpu = DeviceLoad(workers=1, capacity=4, running=4, step_model=XPU_STEPS)  # full
    cpu = DeviceLoad(workers=1, capacity=8, running=0)  # not measured yet
    assert d.choose(xpu, cpu, 10).device == CPU
    cpu.queued = 1  # its probe stream: the next ones wait for a measurement
    decision = d.choose(xpu, cpu, 10)
    assert decision.device == XPU and decision.rule == "slo_queue"
    assert "xPU full (4/4)" in decision.reason and "CPU unmeasured" in decision.reason
    cpu.step_model = CPU_STEPS  # measured: 20 + 10 * 2 = 40 ms with one more
    assert d.choose(xpu, cpu, 10).device == CPU


def test_the_queue_reason_says_full_or_over_the_slo():
    d = slo(50)
    xpu = DeviceLoad(workers=1, capacity=4, running=4, step_model=XPU_STEPS)
    cpu = DeviceLoad(workers=1, capacity=8, running=8, step_model=(0.001, 0.001))
    assert "CPU full (8/8)" in d.choose(xpu, cpu, 10).reason
    cpu.running = 5  # room, but 20 + 10 * 6 = 80 ms
    cpu.step_model = CPU_STEPS
    assert "CPU over the SLO with one more (80 ms > 50 ms)" in d.choose(xpu, cpu, 10).reason


def test_decode_device_forces_a_class_while_it_has_a_decoder():
    xpu = DeviceLoad(workers=1, capacity=64, running=0, step_model=XPU_STEPS)
    cpu = DeviceLoad(workers=1, capacity=8, running=8, step_model=CPU_STEPS)  # full, over SLO
    assert slo(50, decode_device="cpu").choose(xpu, cpu, 10).device == CPU
    xpu.running = 64
    assert slo(50, decode_device="xpu").choose(xpu, cpu, 10).device == XPU
    none = DeviceLoad()
    assert Dispatcher(decode_device="cpu").choose(xpu, none, 10).device == XPU


def test_step_time_model_fits_the_steps_an_engine_ran():
    stats = EngineStats()
    assert stats.step_time_model() is None
    for rows in (1, 2, 4, 8, 4, 2):
        stats.record(0, rows, 0.020 + 0.010 * rows)
    base, per_row = stats.step_time_model()
    assert abs(base - 0.020) < 1e-9 and abs(per_row - 0.010) < 1e-9
    one = EngineStats()
    for _ in range(3):
        one.record(0, 4, 0.040)
    assert one.step_time_model() == (0.020, 0.005), "one batch size: half the step per row"
    prefill_only = EngineStats()
    prefill_only.record(32, 0, 0.5)
    assert prefill_only.step_time_model() is None, "no decode rows: no inter-token latency"


def test_step_tail_is_how_much_slower_the_slow_steps_run():
    stats = EngineStats()
    for _ in range(7):
        stats.record(0, 2, 0.040)
    assert stats.step_tail() == 1.0, "fewer than 8 steps: no tail yet"
    for i in range(40):  # one step in ten takes twice the model's time
        stats.record(0, 2, 0.080 if i % 10 == 0 else 0.040)
    model = stats.step_time_model()
    assert 1.5 < stats.step_tail(model) < 2.0


def test_a_flat_fit_of_noisy_gaps_still_grows_with_the_rows():
    """Gaps of 30 ms at 4 and at 5 rows fit a flat line; the floor keeps half the mean (30 ms at
    4.5 rows) growing with the rows, so one more stream is never predicted free."""
    cadence = TokenCadence()
    for i in range(21):  # 20 gaps, 10 at each size
        cadence.published(4 + i % 2, i * 0.030)
    assert cadence.gaps.model() == (pytest.approx(0.030, abs=1e-4), pytest.approx(0.0, abs=1e-4))
    base, per_row = cadence.gaps.model(TokenCadence.GROWTH_FLOOR)
    assert per_row == pytest.approx(0.5 * 0.030 / 4.5, rel=0.02)
    assert base + 4.5 * per_row == pytest.approx(0.030)


def test_step_tail_reads_the_p99_the_slo_bar_reads():
    stats = EngineStats()
    for i in range(100):  # two steps in a hundred take three times the model's time
        stats.record(0, 2, 0.120 if i % 50 == 0 else 0.040)
    model = stats.step_time_model()
    assert stats.step_tail(model) == pytest.approx(0.120 / (model[0] + 2 * model[1]))
    assert stats.step_tail(model, quantile=0.95) < 1.1, "at p95 the slow steps do not show"


def test_the_cadence_is_the_gap_between_token_events_while_decoding():
    c = TokenCadence()
    c.published(4, 10.000)  # the first event of a run: no gap yet
    c.published(4, 10.030)
    c.published(5, 10.065)
    assert list(c.gaps.samples) == [(4, pytest.approx(0.030)), (5, pytest.approx(0.035))]
    c.idle()  # nothing ran in between: the next gap is not an inter-token latency
    c.published(2, 11.000)
    c.published(None, 11.010)  # a step without decode rows ends the run too
    c.published(2, 11.030)
    assert len(c.gaps) == 2


def test_the_heartbeat_predicts_from_the_cadence_once_it_has_eight_gaps():
    """The engine steps take 20 ms; the worker's loop adds 10 ms around each. The dispatcher
    sees the engine's steps until eight gaps were seen, then the gaps: what a stream gets."""
    stats, cadence = EngineStats(), TokenCadence()
    for _ in range(10):
        stats.record(0, 4, 0.020)
    assert step_fields(stats, cadence)["step_base_ms"] == pytest.approx(10.0)
    for i in range(9):
        cadence.published(4, i * 0.030)
    fields = step_fields(stats, cadence)
    assert fields["step_base_ms"] + 4 * fields["step_row_ms"] == pytest.approx(30.0)
    assert fields["step_tail"] == pytest.approx(1.0)


def test_the_slo_rule_admits_cpu_streams_by_their_tail_latency():
    d = slo(50)
    xpu = DeviceLoad(workers=1, capacity=4, running=4, step_model=XPU_STEPS)  # full
    cpu = DeviceLoad(workers=1, capacity=8, running=1, step_model=CPU_STEPS)
    assert d.choose(xpu, cpu, 10).device == CPU  # 40 ms with one more
    cpu.step_tail = 1.5  # slow steps at 60 ms: past the SLO
    decision = d.choose(xpu, cpu, 10)
    assert (
        decision.device == XPU
        and "CPU over the SLO with one more (60 ms > 50 ms)" in decision.reason
    )
    assert cpu.predicted_itl() == pytest.approx(0.040)  # the typical latency is unchanged


def test_every_decision_names_its_rule():
    xpu = DeviceLoad(workers=1, capacity=4, running=4, step_model=XPU_STEPS)  # full
    cpu = DeviceLoad(workers=1, capacity=8, running=3, step_model=CPU_STEPS)  # 60 ms with one more
    none = DeviceLoad()
    cases = [
        (Dispatcher(auto_pd_offload=False), xpu, cpu, "decode_device"),
        (Dispatcher(decode_device="cpu"), xpu, cpu, "decode_device"),
        (Dispatcher(), xpu, none, "no_cpu_decoder"),
        (Dispatcher(), none, cpu, "no_xpu_decoder"),
        (slo(100), xpu, cpu, "slo"),  # the CPU keeps 100 ms
        (slo(50), xpu, cpu, "slo_queue"),  # neither keeps 50 ms
        (Dispatcher(), xpu, cpu, "capacity"),  # no SLO: the xPU is full
    ]
    for dispatcher, g, c, rule in cases:
        decision = dispatcher.choose(g, c, 10)
        assert decision.rule == rule and rule in RULES, (decision, rule)


def test_a_bad_decode_device_or_slo_is_refused():
    with pytest.raises(ValueError, match="decode_device"):
        Dispatcher(decode_device="gpu")
    with pytest.raises(ValueError, match="slo_itl_s"):
        Dispatcher(slo_itl_s=0)


def test_a_cpu_with_a_free_slot_takes_a_job_queued_on_the_full_xpu_within_the_slo():
    d = slo(50)
    full = DeviceLoad(workers=1, capacity=4, running=4, queued=2, step_model=XPU_STEPS)
    cpu = DeviceLoad(workers=1, capacity=8, running=1, step_model=CPU_STEPS)  # 40 ms with one more
    take = d.take_queued(full, cpu)
    assert take is not None and take.device == CPU and take.rule == "slo_take" in RULES
    assert (
        "taken from the full xPU's queue (6/4): CPU within the SLO (40 ms <= 50 ms)" in take.reason
    )
    # The xPU has room for what waits: its worker takes it next.
    assert d.take_queued(DeviceLoad(workers=1, capacity=4, running=2, queued=2), cpu) is None
    # One more stream would take the CPU past the SLO, or the CPU is full.
    assert d.take_queued(full, DeviceLoad(workers=1, capacity=8, running=3, step_model=CPU_STEPS)) is None  # fmt: skip
    assert d.take_queued(full, DeviceLoad(workers=1, capacity=1, running=1)) is None
    # Unmeasured: one stream at a time, as the prefill-time rule probes it.
    assert d.take_queued(full, DeviceLoad(workers=1, capacity=8)) is not None
    assert d.take_queued(full, DeviceLoad(workers=1, capacity=8, running=1)) is None
    # Only the SLO rule with decode_device auto queues on the xPU for the CPU to take.
    assert Dispatcher().take_queued(full, cpu) is None
    assert slo(50, decode_device="xpu").take_queued(full, cpu) is None
