"""The Grafana dashboard's queries against a real Prometheus scraping a real farm.

tests/test_monitoring.py checks the dashboard's metric names against the farm's registries;
this one runs Debian's `prometheus` (apt-get install -y prometheus) on a free port, scraping
a process farm (echo engine: a gateway, an xPU-class prefill+decode worker and a CPU decode
worker, each with its /metrics) every second, drives streamed requests through the gateway,
and asks Prometheus's HTTP API for every PromQL expression of the dashboard: each must parse
and evaluate (no query error), and the core panels (request rate, TTFT / ITL / e2e quantiles,
tokens/s per device class, queue lengths) must return series with values.

`make test-monitoring` runs it (marker `monitoring`, kept out of `make test`: it needs the
prometheus binary and takes about half a minute); it skips, saying why, without prometheus.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml
from syshax.broker.embedded import free_port

from .conftest import wait_for
from .farm_procs import ProcFarm
from .test_monitoring import DASHBOARD, ROOT, expressions

pytestmark = pytest.mark.monitoring

PROMETHEUS = shutil.which("prometheus")
LOAD_S = 8.0  # seconds of requests: several 1 s scrapes see the counters grow (rate() > 0)
STREAMS = 6  # concurrent streamed requests through the load


def _panel_exprs(title: str) -> list[str]:
    import json

    panels = json.loads(DASHBOARD.read_text())["panels"]
    (panel,) = [p for p in panels if p["title"] == title]
    return [t["expr"] for t in panel["targets"]]


# The core panels: each of their expressions must return at least one series whose
# value is a finite number (> 0 where the load must have moved it).
CORE_POSITIVE = (
    "Request rate by endpoint and status",
    "Time to first token",
    "Inter-token latency",
    "End-to-end request latency",
)
CORE_PRESENT = ("Waiting jobs per stream", "Taken, not finished, per stream")


def _scrape_config(tmp: Path, gateway: int, workers: list[int]) -> Path:
    """deploy/prometheus/prometheus.yml with this farm's localhost ports and a 1 s interval
    (the compose file names compose hosts and scrapes every 5 s)."""
    cfg = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    cfg["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    ports = {"syshax-gateway": [gateway], "syshax-workers": workers}
    for job in cfg["scrape_configs"]:
        job["static_configs"] = [{"targets": [f"127.0.0.1:{p}" for p in ports[job["job_name"]]]}]
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def farm(tmp_path_factory) -> Iterator[tuple[ProcFarm, list[int]]]:
    farm = ProcFarm(tmp_path_factory.mktemp("prom-farm"))
    try:
        farm.start_gateway()
        ports = [free_port(), free_port()]
        # A short step delay: generations span several scrapes, so the queues and the running
        # counts are seen moving, not only the finished totals.
        farm.start_worker("xpu", "prefill,decode", "xpu", 0.02, args=("--port", str(ports[0])))
        farm.start_worker("cpu", "decode", "cpu", 0.02, args=("--port", str(ports[1])))
        farm.wait_registered(["xpu", "cpu"])
        farm.wait_healthy()
        yield farm, ports
    finally:
        farm.stop()


@pytest.fixture(scope="module")
def prometheus(farm, tmp_path_factory) -> Iterator[str]:
    if PROMETHEUS is None:
        pytest.skip(
            "no prometheus binary on PATH: apt-get install -y prometheus (Debian's package)"
        )
    procs, ports = farm
    tmp = tmp_path_factory.mktemp("prometheus")
    config = _scrape_config(tmp, procs.gateways["gateway"], ports)
    check = subprocess.run(["promtool", "check", "config", str(config)], capture_output=True)
    assert check.returncode == 0, check.stdout.decode() + check.stderr.decode()
    port = free_port()
    log = (tmp / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        ready = wait_for(lambda: _answers(f"{url}/-/ready"), 30)
        assert ready, (tmp / "prometheus.log").read_text()[-3000:]
        yield url
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _targets_up(url: str) -> dict[str, str]:
    active = httpx.get(f"{url}/api/v1/targets", timeout=5).json()["data"]["activeTargets"]
    return {t["scrapeUrl"]: t["health"] for t in active}


def _query(url: str, expr: str) -> dict:
    return httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10).json()


def _values(reply: dict) -> list[float]:
    return [float(s["value"][1]) for s in reply["data"]["result"]]


def _drive(farm: ProcFarm) -> int:
    """Streamed chat requests from STREAMS threads for LOAD_S seconds; how many finished."""
    client = farm.client()
    model = client.models.list().data[0].id
    end = time.monotonic() + LOAD_S

    def one_stream(i: int) -> int:
        done = 0
        while time.monotonic() < end:
            words = " ".join(f"w{(i * 5 + k) % 17}" for k in range(12))
            stream = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": f"{i}: {words}"}],
                max_tokens=24,
                stream=True,
            )
            assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            done += 1
        return done

    with ThreadPoolExecutor(STREAMS) as pool:
        return sum(pool.map(one_stream, range(STREAMS)))


def test_promtool_accepts_the_compose_scrape_config():
    """deploy's file as compose mounts it (compose host names: promtool checks the syntax and
    the settings, not whether the hosts resolve)."""
    if shutil.which("promtool") is None:
        pytest.skip("no promtool on PATH: apt-get install -y prometheus (Debian's package)")
    path = ROOT / "deploy/prometheus/prometheus.yml"
    check = subprocess.run(["promtool", "check", "config", str(path)], capture_output=True)
    assert check.returncode == 0, check.stdout.decode() + check.stderr.decode()
    assert b"SUCCESS" in check.stdout


def test_every_dashboard_query_runs_on_prometheus_scraping_a_farm(farm, prometheus):
    procs, _ = farm
    assert wait_for(lambda: set(_targets_up(prometheus).values()) == {"up"}, 15), _targets_up(
        prometheus
    )
    assert len(_targets_up(prometheus)) == 3  # the gateway and both workers
    assert _drive(procs) >= STREAMS
    time.sleep(2.5)  # two more scrapes: the last requests' counts are in Prometheus

    exprs = expressions()
    replies = {e: _query(prometheus, e) for e in exprs}
    errors = {e: r.get("error") for e, r in replies.items() if r.get("status") != "success"}
    assert not errors, f"queries Prometheus refused: {errors}"

    for title in CORE_POSITIVE:
        for expr in _panel_exprs(title):
            values = _values(replies[expr])
            assert values, f"{title}: {expr} returned no series"
            assert all(math.isfinite(v) for v in values), f"{title}: {expr} -> {values}"
            assert max(values) > 0, f"{title}: {expr} -> {values}"
    for title in CORE_PRESENT:
        for expr in _panel_exprs(title):
            values = _values(replies[expr])
            assert values and all(math.isfinite(v) for v in values), f"{title}: {expr}"
    # Tokens/s per device class: the workers' counters carry their class; decode ran on at
    # least one of them (the gateway's own total has none).
    per_class, total = (_values(replies[e]) for e in _panel_exprs("Generated tokens/s per device class"))  # fmt: skip
    assert per_class and max(per_class) > 0 and total and total[0] > 0
    streams = {
        s["metric"]["stream"]
        for s in replies["max by (stream) (syshax:queue_length)"]["data"]["result"]
    }
    assert {"prefill", "decode:xpu", "decode:cpu"} <= streams, streams
