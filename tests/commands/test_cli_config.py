"""`syshax init`, `syshax config` and `syshax check-config`, run in-process through the CLI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from syshax.shared.config import KEY_DOCS, Config, config_keys, load_config, save_config

from syshax.cli import main


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for name in ("SYSHAX_CONFIG", "INFERENCE_OP_MODE", "SYSHAX_QUANTIZE", "NRC", "DEBUG"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "conf" / "config.yaml"


def test_init_writes_defaults_and_refuses_to_overwrite(path: Path, capsys) -> None:
    assert main(["init", "--config", str(path)]) == 0
    assert capsys.readouterr().out.strip() == str(path)
    assert load_config(path) == Config()
    save_config(Config(cpu_max_batch_size=3), path)
    assert main(["init", "--config", str(path)]) == 1
    err = capsys.readouterr().err
    assert f"{path} already exists" in err and "--force" in err
    assert load_config(path).cpu_max_batch_size == 3  # untouched
    assert main(["init", "--config", str(path), "--force"]) == 0
    assert load_config(path) == Config()


def test_init_uses_syshax_config_then_home(tmp_path: Path, monkeypatch, capsys) -> None:
    assert main(["init"]) == 0
    home_file = tmp_path / "home" / ".config" / "syshax" / "config.yaml"
    assert capsys.readouterr().out.strip() == str(home_file) and home_file.is_file()
    monkeypatch.setenv("SYSHAX_CONFIG", str(tmp_path / "env.yaml"))
    assert main(["init"]) == 0
    assert (tmp_path / "env.yaml").is_file()


def test_config_set_get_list(path: Path, capsys) -> None:
    # creates the file from the defaults when missing
    assert main(["config", "xpu.port", "8100", "--config", str(path)]) == 0
    assert capsys.readouterr().out.strip() == f"xpu.port = 8100 ({path})"
    assert main(["config", "auto_pd_offload", "false", "--config", str(path)]) == 0
    assert main(["config", "redis.url", "redis://:pw@h:6379/0", "--config", str(path)]) == 0
    assert main(["config", "api_keys", "k1,k2", "--config", str(path)]) == 0
    cfg = load_config(path)
    assert (cfg.xpu.port, cfg.auto_pd_offload, cfg.api_keys) == (8100, False, ["k1", "k2"])
    assert cfg.redis.url == "redis://:pw@h:6379/0" and cfg.gateway.port == 8010
    capsys.readouterr()
    assert main(["config", "xpu.port", "--config", str(path)]) == 0
    assert capsys.readouterr().out == "8100\n"
    assert main(["config", "xpu.threads", "--config", str(path)]) == 0
    assert capsys.readouterr().out == "null\n"
    assert main(["config", "--list", "--config", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"# {path}"
    assert lines[1:] == [f"{k}: {v}" for k, v in _listing(path).items()]
    assert "xpu.port: 8100" in lines and "auto_pd_offload: false" in lines


def _listing(path: Path) -> dict[str, str]:
    from syshax.shared.config import format_value, get_key

    cfg = load_config(path)
    return {k: format_value(get_key(cfg, k)) for k in config_keys()}


def test_config_reads_defaults_without_a_file(path: Path, capsys) -> None:
    assert main(["config", "cpu_max_batch_size", "--config", str(path)]) == 0
    assert capsys.readouterr().out == "8\n"
    assert not path.exists()  # reading never creates the file
    assert main(["config", "--list", "--config", str(path)]) == 0
    assert "built-in defaults" in capsys.readouterr().out.splitlines()[0]


def test_config_errors(path: Path, capsys) -> None:
    assert main(["config", "xpu.prot", "1", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "unknown key 'xpu.prot'; did you mean 'xpu.port'?" in err and "Valid keys:" in err
    assert not path.exists()
    assert main(["config", "xpu.prot", "--config", str(path)]) == 2
    assert main(["config", "xpu.port", "http", "--config", str(path)]) == 2
    assert "xpu.port: expected an integer, got 'http'" in capsys.readouterr().err
    assert main(["config", "--config", str(path)]) == 2
    assert main(["config", "xpu.port", "--list", "--config", str(path)]) == 2
    path.parent.mkdir(parents=True)
    path.write_text("xpu: [\n")
    assert main(["config", "xpu.port", "8100", "--config", str(path)]) == 1
    assert f"{path}, line 2" in capsys.readouterr().err
    assert path.read_text() == "xpu: [\n"  # a broken file is never overwritten


def test_config_warns_about_new_problems(path: Path, capsys) -> None:
    assert main(["config", "xpu.port", "8010", "--config", str(path)]) == 0
    err = capsys.readouterr().err
    assert "warning: port collision: gateway.port and xpu.port are both 8010" in err
    assert load_config(path).xpu.port == 8010  # saved: the user may be mid-way through a swap


def test_config_model_relative_path_is_made_absolute(
    path: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    monkeypatch.chdir(tmp_path)
    assert main(["config", "model", "m.gguf", "--config", str(path)]) == 0
    assert load_config(path).model == str(tmp_path / "m.gguf")
    assert load_config(path).model_id == "m"


def test_check_config_without_a_file_says_the_defaults_are_used(capsys) -> None:
    # No --config, no $SYSHAX_CONFIG, no file at the default path: nothing is read, and no line
    # presents that path as the config in use.
    assert main(["check-config"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("config: no config file; using the built-in defaults (")
    assert lines[-1] == "config OK: the built-in defaults (no config file)"
    assert [line for line in lines if "config.yaml" in line] == [lines[0]]
    assert "`syshax init` writes one at " in lines[0]


def test_check_config(path: Path, capsys) -> None:
    assert main(["check-config", "--config", str(path)]) == 1  # named but missing
    assert "no such file; run `syshax init" in capsys.readouterr().err
    assert main(["check-config"]) == 0  # nothing anywhere: the defaults, which are fine
    out = capsys.readouterr().out
    assert "using the built-in defaults" in out and "config OK:" in out
    assert "redis: embedded" in out and "(served as SmolLM2-135M-Instruct)" in out
    # The default rule for CPU workers, said in words (the bundled model is a GGUF).
    assert "cpu workers: the GGUF's own blocks as stored (native kernels), fused native " in out
    assert main(["init", "--config", str(path)]) == 0
    capsys.readouterr()
    assert main(["check-config", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == f"config OK: {path}"
    assert "model: default -> " in out and "SmolLM2-135M-Instruct.Q4_1.gguf" in out
    main(["config", "redis.url", "redis://:secret@h:6379/0", "--config", str(path)])
    main(["config", "cpu.port", "8011", "--config", str(path)])
    main(["config", "model", str(path.parent / "missing.gguf"), "--config", str(path)])
    capsys.readouterr()
    assert main(["check-config", "--config", str(path)]) == 1
    out = capsys.readouterr().out
    assert "redis: redis://:***@h:6379/0" in out and "secret" not in out
    assert "  - port collision: xpu.port and cpu.port are both 8011" in out
    assert "  - model: no such file or folder:" in out and "config OK" not in out


def test_check_config_reports_bad_file_and_env(path: Path, monkeypatch, capsys) -> None:
    path.parent.mkdir(parents=True)
    path.write_text("xpu:\n  prot: 1\n")
    assert main(["check-config", "--config", str(path)]) == 1
    assert f"{path}, line 2: unknown key 'xpu.prot'" in capsys.readouterr().err
    path.write_text("")
    monkeypatch.setenv("INFERENCE_OP_MODE", "bogus")
    assert main(["check-config", "--config", str(path)]) == 1
    assert (
        "INFERENCE_OP_MODE='bogus' is not valid; allowed values: fused" in capsys.readouterr().out
    )


def test_check_config_lists_a_bad_thread_count_once(path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "0")
    assert main(["check-config"]) == 1
    out = capsys.readouterr().out
    assert out.count("OMP_NUM_THREADS='0' is not valid") == 1
    assert "1 problem(s):" in out


def test_check_config_says_when_the_env_turns_the_kernels_off(monkeypatch, capsys) -> None:
    monkeypatch.setenv("SYSHAX_QUANTIZE", "none")
    assert main(["check-config"]) == 0
    assert "cpu workers: float PyTorch weights, PyTorch ops;" in capsys.readouterr().out


def test_check_config_says_what_the_kv_cache_holds(path: Path, monkeypatch, capsys) -> None:
    assert main(["check-config"]) == 0
    assert "; KV cache float16 (kv.cache_dtype auto)" in capsys.readouterr().out
    assert main(["init", "--config", str(path)]) == 0
    assert main(["config", "kv.cache_dtype", "q8_0", "--config", str(path)]) == 0
    capsys.readouterr()
    assert main(["check-config", "--config", str(path)]) == 0
    assert "; KV cache q8_0 (kv.cache_dtype)" in capsys.readouterr().out
    monkeypatch.setenv("SYSHAX_QUANTIZE", "none")  # float PyTorch: no 8-bit cache there
    assert main(["check-config", "--config", str(path)]) == 0
    assert "KV cache the model's dtype (kv.cache_dtype q8_0 needs the fused step)" in (
        capsys.readouterr().out
    )


def test_config_help_lists_every_key_subprocess() -> None:
    exe = Path(sys.executable).parent / "syshax"
    out = subprocess.run(
        [str(exe), "config", "--help"], check=True, capture_output=True, text=True
    ).stdout
    for key in config_keys():
        assert f"  {key} = " in out, key
    assert "xpu.port = 8011" in out and "auto_pd_offload = true" in out
    assert KEY_DOCS["cpu_max_batch_size"] in out
    assert "syshax config xpu.port 8100" in out


def test_check_config_loads_the_emulated_profile(path: Path, capsys) -> None:
    assert main(["init", "--config", str(path)]) == 0
    main(["config", "xpu.engine", "emulated", "--config", str(path)])
    main(["config", "slo.itl_ms", "40", "--config", str(path)])
    capsys.readouterr()
    assert main(["check-config", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "xpu worker: EMULATED accelerator 'h100'" in out
    assert "decodes: decode_device auto; inter-token latency SLO 40 ms" in out
    main(["config", "xpu.profile", str(path.parent / "missing.yaml"), "--config", str(path)])
    capsys.readouterr()
    assert main(["check-config", "--config", str(path)]) == 1
    out = capsys.readouterr().out
    assert "  - xpu.profile: unknown accelerator profile" in out and "missing.yaml" in out
    bad = path.parent / "bad.yaml"
    bad.write_text("name: x\n")
    main(["config", "xpu.profile", str(bad), "--config", str(path)])
    capsys.readouterr()
    assert main(["check-config", "--config", str(path)]) == 1
    assert f"  - xpu.profile: {bad}: missing field(s)" in capsys.readouterr().out


def test_config_refuses_decode_device_cpu_with_offload_off(path: Path, capsys) -> None:
    assert main(["config", "auto_pd_offload", "false", "--config", str(path)]) == 0
    before = path.read_text()
    capsys.readouterr()
    assert main(["config", "decode_device", "cpu", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "decode_device: cpu conflicts with auto_pd_offload false" in err
    assert path.read_text() == before  # nothing written: the loader would refuse it
    assert main(["config", "decode_device", "xpu", "--config", str(path)]) == 0
