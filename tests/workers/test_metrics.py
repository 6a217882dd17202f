"""A worker's /metrics and /health endpoint."""

from __future__ import annotations

import time

import httpx
from syshax.broker.embedded import free_port
from syshax.workers.metrics import WorkerMetrics, serve_metrics


def test_metrics_and_health_endpoint():
    m = WorkerMetrics("w1", "cpu", "smol")
    port = free_port()
    server = serve_metrics(m, "127.0.0.1", port)
    try:
        m.running.set(3)
        m.generation_tokens.inc(42)
        m.dispatch.labels(**m.labels, device="cpu", rule="slo").inc()
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        # every series names the served model: a farm of several sums them per model
        labels = 'device_class="cpu",model="smol",worker="w1"'
        assert f"syshax:num_requests_running{{{labels}}} 3.0" in text
        assert f"syshax:generation_tokens_total{{{labels}}} 42.0" in text
        decisions = 'device="cpu",device_class="cpu",model="smol",rule="slo",worker="w1"'
        assert f"syshax:dispatcher_decisions_total{{{decisions}}} 1.0" in text
        ok = httpx.get(f"http://127.0.0.1:{port}/health")
        assert ok.status_code == 200 and ok.json()["status"] == "ok"
        m.last_turn = time.monotonic() - 3600  # a loop that stopped turning
        stalled = httpx.get(f"http://127.0.0.1:{port}/health")
        assert stalled.status_code == 503 and stalled.json()["status"] == "stalled"
        assert httpx.get(f"http://127.0.0.1:{port}/nope").status_code == 404
        # a taken port is reported, not fatal
        assert serve_metrics(WorkerMetrics("w2", "cpu"), "127.0.0.1", port) is None
    finally:
        server.shutdown()


def test_a_local_farms_workers_open_a_metrics_port_only_when_asked(proc_farm):
    """The config's fixed port is one worker's: a test farm's workers get none unless given
    --port (each of them tried 8012, and every one after the first logged the port in use)."""
    farm = proc_farm()
    port = free_port()
    farm.start_worker("cpu-a")
    farm.start_worker("cpu-b")
    farm.start_worker("cpu-c", args=("--port", str(port)))
    farm.wait_registered(["cpu-a", "cpu-b", "cpu-c"])
    assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
    for name in ("cpu-a", "cpu-b", "cpu-c"):
        assert "metrics endpoint not started" not in farm.log(name), farm.log(name)
