"""Dispatcher policy: auto_pd_offload and missing device classes."""

from syshax.broker.dispatcher import CPU, XPU, DeviceLoad, Dispatcher


def test_offload_off_keeps_everything_on_xpu():
    d = Dispatcher(auto_pd_offload=False)
    idle_cpu = DeviceLoad(workers=4, capacity=64, decode_tps=1e6)
    busy_xpu = DeviceLoad(workers=1, capacity=1, running=1, queued=50, decode_tps=1.0)
    assert all(d.choose(busy_xpu, idle_cpu, 10).device == XPU for _ in range(20))


def test_no_cpu_worker_means_xpu_and_no_xpu_worker_means_cpu():
    d = Dispatcher()
    assert d.choose(DeviceLoad(workers=1, capacity=1), DeviceLoad(), 5).device == XPU
    assert d.choose(DeviceLoad(), DeviceLoad(workers=1, capacity=1), 5).device == CPU


def test_history_is_kept_and_capped():
    d = Dispatcher()
    for _ in range(150):
        d.choose(DeviceLoad(workers=1, capacity=1), DeviceLoad(), 5)
    assert len(d.history) == 100 and d.history[-1].reason == "no CPU decode worker"
