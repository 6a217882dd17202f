"""compose.yaml is checked structurally here (no Docker engine on CI machines); with the
docker compose CLI present, `docker compose config` must accept it too."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from syshax.shared.config import config_from_dict

ROOT = Path(__file__).resolve().parents[1]


def _compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def test_services_healthchecks_and_gpu_reservation():
    services = _compose()["services"]
    assert {"redis", "gateway", "gpu-worker", "cpu-worker", "batch-worker", "rq-dashboard"} <= set(
        services
    )
    for name, svc in services.items():
        assert "healthcheck" in svc, name
    devices = services["gpu-worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    for name in ("gateway", "gpu-worker", "cpu-worker"):
        mounts = services[name]["volumes"]
        assert any(m.endswith(":/etc/syshax/config.yaml:ro") for m in mounts), name
    assert services["gateway"]["ports"] == ["127.0.0.1:8010:8010"]


def test_mounted_config_is_valid():
    cfg = config_from_dict(yaml.safe_load((ROOT / "deploy" / "config.yaml").read_text()))
    assert cfg.redis.url == "redis://redis:6379/0" and cfg.gateway.port == 8010


@pytest.mark.skipif(not shutil.which("docker"), reason="docker CLI not installed")
def test_docker_compose_config_accepts_it():
    probe = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip("the docker CLI has no compose plugin here")
    res = subprocess.run(
        ["docker", "compose", "-f", str(ROOT / "compose.yaml"), "config", "-q"],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
