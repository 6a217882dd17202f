"""A CPU worker's kernel environment is read and checked before anything loads."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from syshax.shared.default_model import default_model_path
from syshax.shared.env import EnvError
from syshax.workers.cpu.affinity import AffinityError
from syshax.workers.cpu.options import from_env, resolve_kernels

VARS = ("SYSHAX_QUANTIZE", "INFERENCE_OP_MODE", "NRC", "CUSTOM_CPU_AFFINITY", "OMP_NUM_THREADS")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in VARS:
        monkeypatch.delenv(name, raising=False)


def test_defaults_use_no_kernels():
    opts = from_env(threads=2)
    assert not opts.uses_kernels and opts.cpus is None
    assert opts.engine_kwargs() == {"quantize": None, "op_mode": None, "nrc": None}


@pytest.mark.parametrize(
    ("quantize", "op_mode", "expected"),
    [
        (None, None, ("stored", "fused")),  # a GGUF on the CPU: its own blocks, fused
        ("none", None, (None, None)),  # SYSHAX_QUANTIZE=none: float PyTorch
        (None, "none", (None, None)),  # INFERENCE_OP_MODE=none: float PyTorch
        ("q4_0", None, ("q4_0", "fused")),  # requantize on purpose, fused by default
        ("q8_0", "none", ("q8_0", None)),  # requantize, PyTorch ops
        (None, "fused", ("stored", "fused")),
    ],
)
def test_default_rule_for_a_gguf_on_the_cpu(quantize, op_mode, expected):
    assert resolve_kernels(quantize, op_mode, default_model_path(), "cpu") == expected


def test_default_rule_for_an_hf_folder_and_for_gpus(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_kernels(None, None, tmp_path, "cpu") == (None, None)  # float stays float
    assert resolve_kernels("q4_0", None, tmp_path, "cpu") == ("q4_0", "fused")
    assert resolve_kernels(None, "fused", tmp_path, "cpu") == (None, "fused")
    assert resolve_kernels(None, None, default_model_path(), "cuda:0") == (None, None)


def test_values_are_passed_on(monkeypatch):
    cpu = min(os.sched_getaffinity(0))
    monkeypatch.setenv("SYSHAX_QUANTIZE", "Q4_0")
    monkeypatch.setenv("INFERENCE_OP_MODE", "fused")
    monkeypatch.setenv("NRC", "2")
    monkeypatch.setenv("CUSTOM_CPU_AFFINITY", str(cpu))
    opts = from_env(threads=1)
    assert opts.engine_kwargs() == {"quantize": "q4_0", "op_mode": "fused", "nrc": 2}
    assert opts.cpus == (cpu,)


@pytest.mark.parametrize(
    ("name", "value", "error", "match"),
    [
        ("SYSHAX_QUANTIZE", "q5_k", EnvError, "SYSHAX_QUANTIZE"),
        ("INFERENCE_OP_MODE", "turbo", EnvError, "INFERENCE_OP_MODE"),
        ("NRC", "0", EnvError, "NRC"),
        ("CUSTOM_CPU_AFFINITY", "0-5", AffinityError, "6"),
        ("CUSTOM_CPU_AFFINITY", "1-0", AffinityError, "below start"),
    ],
)
def test_bad_values_fail_with_the_variables_name(monkeypatch, name, value, error, match):
    monkeypatch.setenv(name, value)
    with pytest.raises(error, match=match):
        from_env(threads=2)


def test_worker_refuses_a_bad_affinity_before_loading(tmp_path):
    """`syshax worker` exits 2 with the reason within seconds: no model load, no Redis."""
    env = {k: v for k, v in os.environ.items() if k not in VARS + ("SYSHAX_CONFIG",)}
    # No config file under this HOME: the built-in defaults apply.
    env.update(CUSTOM_CPU_AFFINITY="0-5", HOME=str(tmp_path), XDG_CONFIG_HOME=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, "-m", "syshax.cli", "worker", "--roles", "decode", "--threads", "2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "CUSTOM_CPU_AFFINITY" in proc.stderr and "6" in proc.stderr
