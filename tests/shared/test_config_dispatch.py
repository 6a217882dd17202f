"""The config keys of heterogeneous capacity: xpu.engine, xpu.profile, slo.itl_ms and
decode_device, with auto_pd_offload kept (false = decode_device xpu; false with cpu = error)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from syshax.shared.config import (
    Config,
    ConfigError,
    get_key,
    load_config,
    parse_value,
    set_key,
    validate,
)

CONFLICT = "decode_device: cpu conflicts with auto_pd_offload false"


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("SYSHAX_CONFIG", raising=False)


def _load(tmp_path: Path, text: str) -> Config:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return load_config(path)


def test_defaults_are_the_native_engine_no_slo_and_auto_dispatch():
    cfg = Config()
    assert (cfg.xpu.engine, cfg.xpu.profile) == ("native", "h100")
    assert (cfg.slo.itl_ms, cfg.slo_itl_s, cfg.decode_device) == (None, None, "auto")


def test_valid_values_from_the_file(tmp_path: Path):
    cfg = _load(
        tmp_path,
        "decode_device: cpu\ngpu:\n  engine: emulated\n  profile: a10\nslo:\n  itl_ms: 50\n",
    )
    assert (cfg.decode_device, cfg.xpu.engine, cfg.xpu.profile) == ("cpu", "emulated", "a10")
    assert cfg.slo.itl_ms == 50.0 and cfg.slo_itl_s == pytest.approx(0.05)
    assert _load(tmp_path, "slo:\n  itl_ms: 12.5\n").slo_itl_s == pytest.approx(0.0125)
    assert _load(tmp_path, "slo:\n  itl_ms: null\n").slo.itl_ms is None
    assert _load(tmp_path, "slo:\n").slo.itl_ms is None  # an empty section: its defaults
    assert _load(tmp_path, "xpu:\n  profile: ./my-gpu.yaml\n").xpu.profile == "./my-gpu.yaml"


@pytest.mark.parametrize(
    ("key", "text", "value"),
    [
        ("slo.itl_ms", "50", 50.0),
        ("slo.itl_ms", " 0.5 ", 0.5),
        ("slo.itl_ms", "null", None),
        ("decode_device", "xpu", "xpu"),
        ("xpu.engine", "emulated", "emulated"),
        ("xpu.profile", "a100-40gb", "a100-40gb"),
    ],
)
def test_set_key_parses_the_new_keys(key: str, text: str, value: object):
    assert parse_value(key, text) == value
    assert get_key(set_key(Config(), key, text), key) == value


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("slo:\n  itl_ms: 0\n", "line 2: slo.itl_ms: must be > 0, got 0"),
        ("slo:\n  itl_ms: -5\n", "slo.itl_ms: must be > 0, got -5"),
        ("slo:\n  itl_ms: fast\n", "slo.itl_ms: expected a number, got 'fast'"),
        ("slo:\n  itl_ms: true\n", "slo.itl_ms: expected a number, got True"),
        ("slo:\n  itl_ms: .inf\n", "slo.itl_ms: must be a finite number, got inf"),
        ("slo:\n  itl: 50\n", "unknown key 'slo.itl'; did you mean 'slo.itl_ms'?"),
        ("slo: 50\n", "slo: expected a section with keys slo.itl_ms"),
        ("xpu:\n  engine: tpu\n", "xpu.engine: must be one of native, emulated, vllm; got 'tpu'"),
        ("xpu:\n  profile: ''\n", "xpu.profile: may not be empty"),
        ("decode_device: gpu\n", "decode_device: must be one of auto, xpu, cpu; got 'gpu'"),
    ],
)
def test_bad_values_are_refused_naming_the_key(tmp_path: Path, text: str, message: str):
    with pytest.raises(ConfigError, match=re.escape(message)):
        _load(tmp_path, text)


@pytest.mark.parametrize(
    ("key", "text", "message"),
    [
        ("slo.itl_ms", "0", "must be > 0, got 0.0"),
        ("slo.itl_ms", "fast", "expected a number, got 'fast'"),
        ("decode_device", "both", "must be one of auto, xpu, cpu"),
        ("xpu.engine", "tpu", "must be one of native, emulated, vllm"),
    ],
)
def test_set_key_refuses_bad_values(key: str, text: str, message: str):
    with pytest.raises(ConfigError, match=f"{key}: {message}"):
        set_key(Config(), key, text)


def test_auto_pd_offload_false_means_xpu_and_conflicts_only_with_cpu(tmp_path: Path):
    for device in ("auto", "xpu"):  # no conflict: false keeps every decode on the xPU
        cfg = _load(tmp_path, f"auto_pd_offload: false\ndecode_device: {device}\n")
        assert cfg.auto_pd_offload is False and cfg.decode_device == device
    for device in ("auto", "xpu", "cpu"):  # true (the default) lets decode_device decide
        assert _load(tmp_path, f"auto_pd_offload: true\ndecode_device: {device}\n")
    with pytest.raises(ConfigError, match=f"line 2: {CONFLICT}") as info:
        _load(tmp_path, "auto_pd_offload: false\ndecode_device: cpu\n")
    assert info.value.problems[0][0] == "decode_device"
    assert "set auto_pd_offload true" in str(info.value)


def test_the_conflict_is_refused_by_set_key_and_reported_by_validate():
    off = set_key(Config(), "auto_pd_offload", "false")
    with pytest.raises(ConfigError, match=CONFLICT):
        set_key(off, "decode_device", "cpu")
    cpu = set_key(Config(), "decode_device", "cpu")
    with pytest.raises(ConfigError, match=CONFLICT):
        set_key(cpu, "auto_pd_offload", "false")
    cpu.auto_pd_offload = False  # an assignment is not checked; validate is
    assert any(p.startswith(CONFLICT) for p in validate(cpu))
    assert validate(set_key(Config(), "slo.itl_ms", "50")) == []
