"""The gateway's per-model, per-device-class gauges (`Metrics.set_devices`): sequences running
and waiting, and decode capacity, from the live heartbeats of a farm of several models."""

from __future__ import annotations

from syshax.gateway.metrics import Metrics


def _beat(model: str, cls: str, roles: str, running: int, waiting: int, capacity: int) -> dict:
    return {
        "model": model,
        "device_class": cls,
        "roles": roles,
        "running": str(running),
        "waiting": str(waiting),
        "capacity": str(capacity),
    }


def _sample(m: Metrics, name: str, cls: str, model: str) -> float | None:
    return m.registry.get_sample_value(name, {"device_class": cls, "model": model})


def test_each_model_and_device_class_has_its_own_rows():
    m = Metrics()
    workers = [
        _beat("smol", "xpu", "prefill,decode", 3, 1, 8),
        _beat("smol", "cpu", "decode", 2, 0, 4),
        _beat("smol", "cpu", "decode", 1, 2, 4),
        _beat("big", "xpu", "prefill", 5, 0, 16),  # prefill only: no decode capacity
    ]
    m.set_devices(workers, ["smol", "big"])
    run, wait, cap = (
        "syshax:num_requests_running_by_device",
        "syshax:num_requests_waiting_by_device",
        "syshax:decode_capacity_by_device",
    )
    assert [_sample(m, n, "xpu", "smol") for n in (run, wait, cap)] == [3, 1, 8]
    assert [_sample(m, n, "cpu", "smol") for n in (run, wait, cap)] == [3, 2, 8]
    assert [_sample(m, n, "xpu", "big") for n in (run, wait, cap)] == [5, 0, 0]
    assert [_sample(m, n, "cpu", "big") for n in (run, wait, cap)] == [0, 0, 0]  # served, idle


def test_a_model_no_longer_served_loses_its_rows_and_odd_classes_are_skipped():
    m = Metrics()
    m.set_devices([_beat("old", "xpu", "decode", 1, 0, 2)], ["smol"])
    assert _sample(m, "syshax:decode_capacity_by_device", "xpu", "old") == 2
    m.set_devices([_beat("smol", "tpu", "decode", 1, 0, 2)], ["smol"])
    assert _sample(m, "syshax:decode_capacity_by_device", "xpu", "old") is None
    assert _sample(m, "syshax:decode_capacity_by_device", "tpu", "smol") is None
    assert _sample(m, "syshax:decode_capacity_by_device", "xpu", "smol") == 0
