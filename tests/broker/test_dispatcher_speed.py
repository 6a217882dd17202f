"""Dispatcher policy: speed. The CPU takes a job only if it would not become the tail."""

from syshax.broker.dispatcher import CPU, XPU, DeviceLoad, Dispatcher


def test_slow_cpu_is_not_the_tail():
    d = Dispatcher(cpu_max_batch_size=8)
    xpu = DeviceLoad(workers=1, capacity=64, running=4, decode_tps=400.0)  # 80 tok/s per new seq
    cpu = DeviceLoad(workers=1, capacity=8, running=0, decode_tps=20.0)  # 20 tok/s
    assert d.choose(xpu, cpu, 100).device == XPU


def test_cpu_takes_work_when_the_xpu_is_crowded():
    d = Dispatcher(cpu_max_batch_size=8)
    xpu = DeviceLoad(workers=1, capacity=64, running=40, queued=9, decode_tps=500.0)  # 10 tok/s
    cpu = DeviceLoad(workers=1, capacity=8, running=1, decode_tps=60.0)  # 30 tok/s
    decision = d.choose(xpu, cpu, 100)
    assert decision.device == CPU and "CPU finishes first" in decision.reason


def test_without_measurements_balance_by_fill_fraction():
    d = Dispatcher(cpu_max_batch_size=4)
    xpu = DeviceLoad(workers=1, capacity=16, running=8)
    cpu = DeviceLoad(workers=1, capacity=4, running=1)
    assert d.choose(xpu, cpu, 10).device == CPU  # 1/4 < 8/16
    cpu.running = 3
    assert d.choose(xpu, cpu, 10).device == XPU  # 3/4 > 8/16


def test_a_burst_spreads_without_leaving_the_cpu_as_tail():
    """Feed a burst one job at a time; the CPU's share stays where it keeps pace."""
    d = Dispatcher(cpu_max_batch_size=8)
    xpu = DeviceLoad(workers=1, capacity=32, decode_tps=200.0)
    cpu = DeviceLoad(workers=1, capacity=8, decode_tps=50.0)
    for _ in range(30):
        target = xpu if d.choose(xpu, cpu, 64).device == XPU else cpu
        target.queued += 1
    # per-sequence speeds at the end must be close: neither side is left far behind
    assert cpu.queued > 0
    assert cpu.per_sequence_tps() * 1.5 >= xpu.per_sequence_tps() or cpu.queued == 0
