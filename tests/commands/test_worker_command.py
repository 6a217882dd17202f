"""`syshax worker` and `syshax run` with the emulated accelerator: which engine and device class
a worker gets, the profile checks, the EmulatedEngine it builds, the help text. (The rules
live in workers/settings.py and workers/build.py.)"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest
from syshax.shared.config import KEY_DOCS, Config, save_config, set_key
from syshax.workers import settings, worker_defaults
from syshax.workers.accelerator_profiles import BUILTIN_PROFILES
from syshax.workers.build import build_engine
from syshax.workers.settings import WorkerOverrides, WorkerSettings

from syshax.cli import build_parser, main
from syshax.commands import run


@pytest.fixture(autouse=True)
def _root_level():
    """`main` applies the config's log level to the root logger: put it back afterwards."""
    root = logging.getLogger()
    level = root.level
    yield
    root.setLevel(level)


def _cfg(**keys: str) -> Config:
    cfg = Config()
    for key, value in keys.items():
        cfg = set_key(cfg, key.replace("__", "."), value)
    return cfg


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["worker", *argv])


def _overrides(*argv: str) -> WorkerOverrides:
    return WorkerOverrides.of(_args(*argv))


def _resolve(cfg: Config, *argv: str) -> tuple[str, str]:
    o = _overrides(*argv)
    return settings.engine_and_class(cfg, o, frozenset(o.roles.split(",")))


def test_the_xpu_class_follows_xpu_engine_and_the_cpu_class_runs_the_model():
    emulated = _cfg(xpu__engine="emulated")
    assert _resolve(emulated) == ("emulated", "xpu")  # prefill,decode: the xPU role
    assert _resolve(emulated, "--roles", "decode") == ("native", "cpu")
    assert _resolve(emulated, "--roles", "decode", "--device-class", "xpu") == ("emulated", "xpu")
    assert _resolve(emulated, "--engine", "native") == ("native", "xpu")  # --engine wins
    assert _resolve(Config()) == ("native", "xpu")  # native
    # --engine emulated is an accelerator: the xPU class even for a decode-only worker
    assert _resolve(Config(), "--engine", "emulated", "--roles", "decode") == ("emulated", "xpu")
    assert _resolve(Config(), "--engine", "echo", "--roles", "decode") == ("echo", "cpu")


@pytest.mark.parametrize(
    ("argv", "keys", "message"),
    [
        (("--engine", "emulated", "--device-class", "cpu"), {}, "serves the xPU class"),
        (("--engine", "emulated", "--device", "cuda"), {}, "--device does not apply"),
        (("--engine", "emulated", "--profile", "nope"), {}, "--profile: unknown accelerator"),
        (("--engine", "emulated",), {"xpu__profile": "/no/such.yaml"}, "xpu.profile: unknown"),
        (("--engine", "native", "--profile", "a10"), {}, "--profile is for the emulated engine"),
    ],
)  # fmt: skip
def test_emulated_options_that_do_not_fit_are_refused(argv, keys, message):
    cfg = _cfg(**keys)
    o = _overrides(*argv)
    engine, cls = settings.engine_and_class(cfg, o, frozenset(o.roles.split(",")))
    with pytest.raises(ValueError, match=message):
        settings.emulated_profile(cfg, o, engine, cls)
    with pytest.raises(ValueError, match=message):  # the same refusal from the one entry point
        WorkerSettings.from_config(cfg, o)


def test_the_profile_comes_from_the_option_else_the_config():
    cfg = _cfg(xpu__profile="a100-40gb")
    emulated = _overrides("--engine", "emulated")
    assert settings.emulated_profile(cfg, emulated, "emulated", "xpu").name == "a100-40gb"
    o = _overrides("--engine", "emulated", "--profile", "a10")
    assert settings.emulated_profile(cfg, o, "emulated", "xpu").name == "a10"
    assert settings.emulated_profile(cfg, _overrides("--engine", "native"), "native", "xpu") is None


def test_build_engine_makes_an_emulated_engine_with_the_workers_settings():
    cfg = _cfg(max_model_len="512", max_num_batched_tokens="4", kv__prefix_caching="false")
    o = _overrides("--engine", "emulated", "--profile", "a10", "--max-batch-size", "5")
    worker = WorkerSettings.from_config(cfg, o)
    assert (worker.device, worker.slots, worker.handoff_slots) == ("emulated:a10", 5, 1)
    engine = build_engine(worker)
    assert engine.emulated and engine.profile.name == "a10"
    assert engine.max_model_len == 512 and engine.num_slots == worker.engine_slots == 6
    assert engine.scheduler.max_num_batched_tokens == 6  # raised to the slots
    assert engine.scheduler.blocks.prefix_caching is False
    assert engine.tokenizer is not None  # real text for the echoed tokens


def test_prompt_rows_while_decoding_defaults_to_a_cap_on_the_cpu_only():
    from syshax.shared.config_schema import DEFAULT_CPU_PROMPT_ROWS_WHILE_DECODING as CAP

    assert worker_defaults.prompt_rows_while_decoding(Config(), "cpu") == CAP
    assert worker_defaults.prompt_rows_while_decoding(Config(), "cuda") is None
    cfg = _cfg(prompt_rows_while_decoding="16")
    assert worker_defaults.prompt_rows_while_decoding(cfg, "cpu") == 16
    assert worker_defaults.prompt_rows_while_decoding(cfg, "cuda") == 16


def test_a_bad_profile_or_class_exits_2_before_anything_starts(tmp_path: Path, caplog):
    path = tmp_path / "config.yaml"
    save_config(_cfg(xpu__engine="emulated", xpu__profile="no-such-gpu"), path)
    with caplog.at_level(logging.ERROR):
        assert main(["worker", "--config", str(path)]) == 2
    assert "xpu.profile: unknown accelerator profile 'no-such-gpu'" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.ERROR):
        argv = ["worker", "--config", str(path), "--engine", "emulated", "--device-class", "cpu"]
        assert main(argv) == 2
    assert "serves the xPU class" in caplog.text


def test_syshax_run_checks_the_profile_before_starting_anything(tmp_path: Path, capsys):
    path = tmp_path / "config.yaml"
    save_config(_cfg(xpu__engine="emulated", xpu__profile="no-such-gpu"), path)
    assert main(["run", "--config", str(path), "--no-gateway"]) == 2
    assert "xpu.profile: unknown accelerator profile" in capsys.readouterr().err


def test_syshax_run_with_xpu_engine_emulated_starts_an_emulated_xpu_and_real_cpu_workers():
    cfg = _cfg(xpu__engine="emulated", xpu__device="cpu")
    assert run.layout(cfg, None) == (1, None), "an emulated accelerator is an accelerator"
    args = argparse.Namespace(engine=None, cpu_workers=None, no_gateway=True)
    children = {c.name: c.argv for c in run._children(args, cfg, None)}
    assert list(children) == ["xpu-worker", "cpu-worker-0", "batch-worker"]
    xpu, cpu = children["xpu-worker"], children["cpu-worker-0"]
    assert xpu[xpu.index("--engine") + 1] == "emulated" and "--threads" not in xpu
    assert cpu[cpu.index("--engine") + 1] == "native"
    # --engine echo: the stand-in everywhere; --engine emulated without xpu.engine set
    assert run.engines(cfg, "echo") == ("echo", "echo")
    assert run.engines(Config(), "emulated") == ("emulated", "native")
    assert run.engines(Config(), None) == ("native", "native")


def test_help_explains_the_engines_and_the_profile(capsys):
    for command in ("worker", "run"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "emulated" in text and "xpu.engine" in text, command
    with pytest.raises(SystemExit):
        main(["worker", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--profile NAME|PATH" in text and "xpu.profile" in text


def test_the_profile_key_lists_every_builtin_profile():
    assert all(name in KEY_DOCS["xpu.profile"] for name in BUILTIN_PROFILES)


def test_the_seed_names_of_an_engine_and_a_class_still_work_with_a_warning(capsys):
    """`--engine model` and `--device-class gpu` (the seed's names) mean native and xpu, as the
    config says; each warns once on stderr. Other values stay refused."""
    assert _resolve(Config(), "--engine", "model", "--device-class", "gpu") == ("native", "xpu")
    err = capsys.readouterr().err
    assert "--engine model is the old name of --engine native" in err
    assert "--device-class gpu is the old name of --device-class xpu" in err
    run_args = build_parser().parse_args(["run", "--engine", "model"])
    assert run_args.engine == "native"
    with pytest.raises(SystemExit):
        _args("--device-class", "tpu")
