"""`syshax run` publishes where its farm is; the client commands started beside it find it
with no flags (shared/farm_file.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from syshax.shared import farm_file
from syshax.shared.config import Config


@pytest.fixture
def state(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    return tmp_path


def test_publish_find_remove(state):
    config = state / "a.yaml"
    path = farm_file.publish(config, "syshax", "redis://127.0.0.1:1234/0", "http://h:1/v1")
    info = farm_file.find(config, "syshax")
    assert info is not None and (info.pid, info.redis_url) == (
        os.getpid(),
        "redis://127.0.0.1:1234/0",
    )
    assert info.gateway_url == "http://h:1/v1" and info.config == str(config)
    # Another config file or another key prefix is another farm.
    assert farm_file.find(state / "b.yaml", "syshax") is None
    assert farm_file.find(config, "other") is None
    farm_file.remove(path)
    assert not path.exists() and farm_file.find(config, "syshax") is None


def test_a_dead_farms_file_is_ignored_and_removed(state):
    config = state / "a.yaml"
    path = farm_file.publish(config, "syshax", "redis://127.0.0.1:1/0", "http://h:1/v1")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)  # fmt: skip
    text = path.read_text().replace(f'"pid": {os.getpid()}', f'"pid": {int(dead.stdout)}')
    path.write_text(text)
    assert farm_file.find(config, "syshax") is None
    assert not path.exists()


def test_an_explicit_url_or_redis_url_wins(state, capsys):
    config = state / "a.yaml"
    farm_file.publish(config, "syshax", "redis://farm:1/0", "http://h:1/v1")
    cfg = Config()
    assert farm_file.redis_url("redis://flag:2/0", cfg, config, "top") == "redis://flag:2/0"
    cfg.redis.url = "redis://cfg:3/0"
    assert farm_file.redis_url(None, cfg, config, "top") == "redis://cfg:3/0"
    cfg.redis.url = None
    assert farm_file.redis_url(None, cfg, config, "top") == "redis://farm:1/0"
    assert "syshax top: using the farm of `syshax run` (pid" in capsys.readouterr().err


def test_top_finds_the_running_farm_with_no_flags(state, redis_url):
    """A client command in another shell: no --redis-url, no redis.url, the same (default)
    config: it reads the farm file and talks to that Redis."""
    home = state / "home"
    config = home / ".config" / "syshax" / "config.yaml"
    farm_file.publish(config, "syshax", redis_url, "http://127.0.0.1:1/v1")
    run_env = {k: v for k, v in os.environ.items() if k not in ("SYSHAX_CONFIG", "XDG_STATE_HOME")}
    run_env.update(HOME=str(home), XDG_STATE_HOME=str(state / "state"))
    proc = subprocess.run(
        [sys.executable, "-m", "syshax.cli", "top", "--once"],
        capture_output=True,
        text=True,
        env=run_env,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"using the farm of `syshax run` (pid {os.getpid()}" in proc.stderr
    empty = subprocess.run(
        [sys.executable, "-m", "syshax.cli", "top", "--once"],
        capture_output=True,
        text=True,
        env={**run_env, "XDG_STATE_HOME": str(state / "nothing")},
        timeout=60,
    )
    assert empty.returncode == 2 and "start the farm with `syshax run`" in empty.stderr
