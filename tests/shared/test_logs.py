"""The config's log_level reaches the root logger of long-running commands; DEBUG=1 wins."""

from __future__ import annotations

import logging

import pytest
from syshax.shared import logs


@pytest.fixture(autouse=True)
def keep_root_level():
    root = logging.getLogger()
    before = root.level
    yield
    root.setLevel(before)


@pytest.mark.parametrize("name", ["debug", "info", "warning", "error", "critical"])
def test_the_config_level_is_applied(monkeypatch, name):
    monkeypatch.delenv("DEBUG", raising=False)
    assert logs.apply_log_level(name) == name
    assert logging.getLogger().level == getattr(logging, name.upper())


def test_debug_env_forces_debug(monkeypatch):
    monkeypatch.setenv("DEBUG", "1")
    assert logs.apply_log_level("error") == "debug"
    assert logging.getLogger().level == logging.DEBUG
    assert logs.start_level() == logging.DEBUG
    monkeypatch.setenv("DEBUG", "0")
    assert logs.start_level() == logging.WARNING


def test_every_long_running_command_applies_the_config_level():
    """run, worker, gateway and the batch worker each call apply_log_level after loading the
    config (a config key nobody reads was the bug)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "syshax" / "commands"
    for name in ("run", "worker", "gateway", "batch"):
        assert "apply_log_level(" in (root / f"{name}.py").read_text(), name
