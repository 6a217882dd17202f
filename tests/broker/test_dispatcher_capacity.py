"""Dispatcher policy: capacity. A full device gets no work while the other has room."""

from syshax.broker.dispatcher import CPU, XPU, DeviceLoad, Dispatcher


def test_cpu_at_capacity_sends_to_xpu():
    d = Dispatcher(cpu_max_batch_size=4)
    cpu = DeviceLoad(workers=1, capacity=16, running=3, queued=1, decode_tps=1000.0)  # capped to 4
    xpu = DeviceLoad(workers=1, capacity=16, running=10, decode_tps=10.0)
    assert d.choose(xpu, cpu, 50).device == XPU


def test_xpu_at_capacity_sends_to_cpu():
    d = Dispatcher(cpu_max_batch_size=8)
    xpu = DeviceLoad(workers=1, capacity=4, running=4, decode_tps=1000.0)
    cpu = DeviceLoad(workers=1, capacity=8, running=0, decode_tps=10.0)
    assert d.choose(xpu, cpu, 50).device == CPU


def test_never_exceeds_capacity_while_other_has_room():
    d = Dispatcher(cpu_max_batch_size=2)
    xpu, cpu = DeviceLoad(workers=1, capacity=6), DeviceLoad(workers=1, capacity=8)
    for _ in range(8):
        choice = d.choose(xpu, cpu, 10).device
        target = xpu if choice == XPU else cpu
        target.queued += 1
        assert cpu.load <= 2 and xpu.load <= 6
    assert cpu.load == 2 and xpu.load == 6


def test_both_full_queues_where_the_wait_is_shorter():
    d = Dispatcher(cpu_max_batch_size=4)
    xpu = DeviceLoad(workers=1, capacity=8, running=8, queued=8)  # 2x capacity
    cpu = DeviceLoad(workers=1, capacity=4, running=4, queued=1)  # 1.25x
    assert d.choose(xpu, cpu, 10).device == CPU
    cpu.queued = 20
    assert d.choose(xpu, cpu, 10).device == XPU
