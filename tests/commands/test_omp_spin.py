"""`syshax` sets libgomp's GOMP_SPINCOUNT for its processes (short spins: no core held busy
between steps), unless the user chose a spin or a wait policy."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from syshax.shared import env


@pytest.fixture(autouse=True)
def _no_omp_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)


def test_the_default_is_set_when_nothing_is_asked() -> None:
    env.use_short_omp_spin()
    assert os.environ["GOMP_SPINCOUNT"] == env.GOMP_SPINCOUNT_DEFAULT


@pytest.mark.parametrize(("name", "value"), [("GOMP_SPINCOUNT", "300000"), ("OMP_WAIT_POLICY", "active")])  # fmt: skip
def test_a_user_setting_wins(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    monkeypatch.setenv(name, value)
    env.use_short_omp_spin()
    assert os.environ[name] == value
    if name == "OMP_WAIT_POLICY":
        assert "GOMP_SPINCOUNT" not in os.environ


def test_a_syshax_process_has_it_before_torch_loads(tmp_path) -> None:
    """In a fresh process (libgomp reads it once, when it loads): the CLI sets it before any
    command runs, and no command module imports torch at import time."""
    code = (
        "import os, sys\n"
        "from syshax import cli\n"
        "cli.main(['config', 'model'])\n"
        "print('torch loaded early:', 'torch' in sys.modules)\n"
        "print('spin:', os.environ.get('GOMP_SPINCOUNT'))\n"
    )
    environ = {
        k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")
    }
    environ["HOME"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environ, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "torch loaded early: False" in out.stdout
    assert f"spin: {env.GOMP_SPINCOUNT_DEFAULT}" in out.stdout
