"""The monitoring set-up (compose's `monitoring` profile, deploy/prometheus, deploy/grafana):
every metric the Grafana dashboard queries is one the farm exports, and Prometheus scrapes
the services that export them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from prometheus_client import CollectorRegistry
from syshax.gateway.metrics import Metrics
from syshax.workers.metrics import WorkerMetrics

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "syshax-farm.json"
# A metric name in PromQL: letters, digits, _ and the colons of recording-rule style names.
# Every farm metric has a colon (syshax:...); any other colon name is a metric nobody exports.
METRIC = re.compile(r"(?<![\w:\"'])([a-zA-Z_][a-zA-Z0-9_]*:[a-zA-Z0-9_:]*)")
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def exported(registry: CollectorRegistry) -> set[str]:
    """The sample names a registry exposes, labelled or not (a labelled metric with no child
    yet has no sample: the name is derived from its family and type)."""
    names = set()
    for family in registry.collect():
        names.update(family.name + s for s in SUFFIXES.get(family.type, ("",)))
    return names


def farm_metrics() -> set[str]:
    return exported(Metrics().registry) | exported(WorkerMetrics("w0", "cpu").registry)


def queried(expr: str) -> set[str]:
    return set(METRIC.findall(expr))


def expressions() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [t["expr"] for p in panels for t in p.get("targets", [])]


def test_the_name_parser_finds_metric_names_and_only_them():
    expr = 'histogram_quantile(0.9, sum by (le) (rate(syshax:ttft_bucket{status=~"5.."}[1m])))'
    assert queried(expr) == {"syshax:ttft_bucket"}
    assert queried("max by (stream) (vllm:queue) / syshax:b") == {"vllm:queue", "syshax:b"}
    assert "syshax:requests_total" in farm_metrics()
    assert {"syshax:inter_token_latency_seconds_bucket", "syshax:worker_capacity"} <= farm_metrics()


def test_every_metric_the_dashboard_queries_is_exported():
    exprs = expressions()
    assert len(exprs) >= 15
    known = farm_metrics()
    unknown = {name: e for e in exprs for name in queried(e) if name not in known}
    assert not unknown, f"queried but not exported: {unknown}"
    assert all(queried(e) for e in exprs), "a panel queries no farm metric"
    # The list: request rate, latency quantiles, tokens/s, queues, KV, dispatcher, errors.
    used = set().union(*(queried(e) for e in exprs))
    for name in (
        "syshax:requests_total",
        "syshax:time_to_first_token_seconds_bucket",
        "syshax:inter_token_latency_seconds_bucket",
        "syshax:e2e_request_latency_seconds_bucket",
        "syshax:generation_tokens_total",
        "syshax:queue_length",
        "syshax:kv_cache_usage_perc",
        "syshax:dispatcher_decisions_total",
    ):
        assert name in used, name


def test_the_dashboard_uses_the_provisioned_datasource():
    source = yaml.safe_load(
        (ROOT / "deploy/grafana/provisioning/datasources/prometheus.yaml").read_text()
    )["datasources"][0]
    uids = {
        t["datasource"]["uid"]
        for p in json.loads(DASHBOARD.read_text())["panels"]
        for t in p.get("targets", [])
    }
    assert uids == {source["uid"]} and source["url"] == "http://prometheus:9090"


def test_compose_monitoring_profile_scrapes_the_farm():
    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    for name in ("prometheus", "grafana"):
        assert services[name]["profiles"] == ["monitoring"], name
    assert all(
        "profiles" not in s for n, s in services.items() if n not in ("prometheus", "grafana")
    )
    mounts = services["prometheus"]["volumes"]
    assert "./deploy/prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in mounts
    scrape = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    targets = {
        t for job in scrape["scrape_configs"] for c in job["static_configs"] for t in c["targets"]
    }
    cfg = yaml.safe_load((ROOT / "deploy/config.yaml").read_text())
    gateway = cfg.get("gateway") or cfg["conductor"]  # the section's name or its seed alias
    assert f"gateway:{gateway['port']}" in targets
    for service in ("gpu-worker", "cpu-worker"):
        assert any(t.startswith(f"{service}:") for t in targets), service
    # The workers' /metrics listen beyond their container's loopback, or nothing reaches them.
    xpu = cfg.get("xpu") or cfg["gpu"]  # the section's new name or its alias
    assert xpu["host"] == "0.0.0.0" and cfg["cpu"]["host"] == "0.0.0.0"


# Grafana itself is in no package registry this project reaches (not in Debian; PyPI's and
# npm's "grafana" packages are clients and libraries, not the server), so the dashboard is
# checked here for the shape Grafana's file provisioning loads; its PromQL runs on a real
# Prometheus in tests/test_prometheus_live.py (`make test-monitoring`).
PANEL_TYPES = {"row", "timeseries", "stat", "gauge", "bargauge", "table", "heatmap"}
GRID_COLUMNS = 24  # Grafana's grid width


def test_the_dashboard_has_the_shape_grafana_provisions():
    board = json.loads(DASHBOARD.read_text())
    assert board["uid"] and board["title"] and isinstance(board["schemaVersion"], int)
    assert board["time"]["from"].startswith("now-") and board["refresh"]
    panels = board["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) for i in ids), ids
    cells: dict[tuple[int, int], int] = {}
    for p in panels:
        assert p["type"] in PANEL_TYPES, (p["id"], p["type"])
        assert p["title"], p["id"]
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in ("x", "y", "w", "h")), p["id"]
        assert g["w"] > 0 and g["h"] > 0 and g["x"] >= 0 and g["x"] + g["w"] <= GRID_COLUMNS
        for x in range(g["x"], g["x"] + g["w"]):  # no two panels on one grid cell
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"panels {cells.get((x, y))} and {p['id']} overlap"
                cells[x, y] = p["id"]
        if p["type"] == "row":
            assert not p.get("targets"), p["id"]
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "syshax-prometheus"}, p["id"]
        refs = [t["refId"] for t in p["targets"]]
        assert p["targets"] and len(refs) == len(set(refs)), (p["id"], refs)
        for t in p["targets"]:
            assert isinstance(t["expr"], str) and t["expr"].strip(), (p["id"], t)
            assert t["expr"].count("(") == t["expr"].count(")"), (p["id"], t["expr"])
            assert t["datasource"] == p["datasource"], (p["id"], t["refId"])


def test_grafana_provisioning_finds_the_dashboard_where_compose_mounts_it():
    grafana = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]["grafana"]
    mounts = dict(v.rsplit(":", 1)[0].split(":", 1) for v in grafana["volumes"])
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    provider = yaml.safe_load(
        (ROOT / "deploy/grafana/provisioning/dashboards/syshax.yaml").read_text()
    )["providers"][0]
    assert provider["type"] == "file"
    assert mounts["./deploy/grafana/dashboards"] == provider["options"]["path"]
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{provider['options']['path']}/{DASHBOARD.name}"
