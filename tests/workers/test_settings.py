"""A worker's settings, decided once (workers/settings.py), and the engine built from them
(workers/build.py): each default has one rule, which `syshax worker`, `syshax run`,
`check-config` and `plan` all read."""

from __future__ import annotations

import dataclasses

import pytest
from syshax.shared.config import Config, resolve_threads, set_key
from syshax.shared.config_schema import DEFAULT_CPU_PROMPT_ROWS_WHILE_DECODING
from syshax.workers import build
from syshax.workers.build import build_engine
from syshax.workers.echo_engine import EchoEngine, EchoRunner
from syshax.workers.emulated_engine import EmulatedEngine, EmulatedRunner
from syshax.workers.farm_layout import cpu_threads, every_core, farm_layout
from syshax.workers.settings import (
    ENGINES,
    Priority,
    SettingsError,
    WorkerOverrides,
    WorkerSettings,
)

from syshax.commands import run

EVERY, HALF = every_core(), resolve_threads(None)
XPU = WorkerOverrides(device_class="xpu")  # how `syshax run` starts the xPU-role worker
CPU = WorkerOverrides(roles="decode", device="cpu", device_class="cpu")  # and a CPU one


def _cfg(**keys: str) -> Config:
    cfg = Config()
    for key, value in keys.items():
        cfg = set_key(cfg, key.replace("__", "."), value)
    return cfg


@pytest.fixture(autouse=True)
def _no_thread_env(monkeypatch):
    for name in ("OMP_NUM_THREADS", "CUSTOM_CPU_AFFINITY", "SYSHAX_QUANTIZE", "INFERENCE_OP_MODE"):
        monkeypatch.delenv(name, raising=False)


# ---- threads: one rule for a bare worker and the farm ---------------------------------------


@pytest.mark.parametrize(
    ("keys", "cpu_workers", "expected"),
    [
        ({}, None, EVERY),  # no accelerator, no CPU workers: the only worker, every core
        ({"cpu__workers": "1"}, None, HALF),  # the split asked in the config
        ({}, 1, HALF),  # the split asked on syshax run's command line
        ({"cpu__workers": "2"}, 0, EVERY),  # and undone there
        ({"xpu__threads": "3"}, None, 3),  # as set
    ],
)
def test_the_xpu_worker_gets_the_same_threads_bare_or_started_by_syshax_run(
    keys, cpu_workers, expected
):
    cfg = _cfg(xpu__device="cpu", **keys)  # a host without accelerator
    layout = farm_layout(cfg, "native", cpu_workers)
    started = WorkerSettings.from_config(
        cfg, dataclasses.replace(XPU, engine=layout.xpu_engine, threads=layout.xpu_threads)
    )
    assert started.threads == expected
    if cpu_workers is None:  # nothing overridden: a bare `syshax worker` is that worker
        assert WorkerSettings.from_config(cfg, WorkerOverrides()).threads == expected
    assert run.layout(cfg, cpu_workers) == (layout.cpu_workers, layout.xpu_threads)


def test_an_accelerator_or_vllm_keeps_the_default_threads():
    emulated = farm_layout(_cfg(xpu__device="cpu"), "emulated")
    assert (emulated.cpu_workers, emulated.xpu_threads) == (1, None)  # an accelerator
    vllm = farm_layout(_cfg(xpu__device="cpu"), "vllm")
    assert (vllm.xpu_engine, vllm.cpu_engine, vllm.xpu_threads) == ("vllm", "native", None)
    cuda = _cfg(xpu__device="cuda")
    assert (farm_layout(cuda).cpu_workers, farm_layout(cuda).xpu_threads) == (1, None)


def test_cpu_workers_take_omp_num_threads_then_cpu_threads(monkeypatch):
    assert WorkerSettings.from_config(Config(), CPU).threads == HALF
    assert WorkerSettings.from_config(_cfg(cpu__threads="3"), CPU).threads == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert WorkerSettings.from_config(_cfg(cpu__threads="3"), CPU).threads == 5
    assert cpu_threads(_cfg(cpu__threads="3")) == 5  # check-config's and plan's
    cpu = dataclasses.replace(CPU, threads=2)
    assert WorkerSettings.from_config(Config(), cpu).threads == 2, "--threads wins"
    monkeypatch.setenv("OMP_NUM_THREADS", "many")
    with pytest.raises(SettingsError, match="OMP_NUM_THREADS='many'"):
        WorkerSettings.from_config(Config(), CPU)


# ---- the other defaults ---------------------------------------------------------------------


def test_a_cpu_decode_worker_as_syshax_run_starts_it():
    s = WorkerSettings.from_config(Config(), CPU)
    assert (s.engine, s.device_class, s.device, s.roles) == ("native", "cpu", "cpu", {"decode"})
    assert (s.slots, s.handoff_slots) == (Config().cpu_max_batch_size, 0)
    assert s.max_num_batched_tokens == Config().max_num_batched_tokens
    assert s.prompt_rows_while_decoding == DEFAULT_CPU_PROMPT_ROWS_WHILE_DECODING
    assert s.priority == Priority(sched_idle=True, nice=10)
    assert s.kernels is not None and (s.kernels.quantize, s.kernels.op_mode) == ("stored", "fused")
    assert (s.metrics_host, s.metrics_port) == (Config().cpu.host, Config().cpu.port)
    assert s.served_model == Config().model_id and s.worker_id.startswith("cpu-")
    assert (s.max_model_len, s.dtype, s.kv_cache_bytes) == (2048, "float32", None)


def test_an_accelerator_worker_gets_a_handoff_slot_and_no_prompt_row_cap():
    cfg = _cfg(max_num_batched_tokens="4", kv__cache_mib="64")
    s = WorkerSettings.from_config(cfg, WorkerOverrides(engine="emulated", max_batch_size=5))
    assert (s.device_class, s.device, s.profile.name) == ("xpu", "emulated:h100", "h100")
    assert (s.slots, s.handoff_slots, s.engine_slots) == (5, 1, 6)
    assert s.max_num_batched_tokens == 6  # raised to the engine's slots
    assert s.prompt_rows_while_decoding is None and s.priority is None and s.kernels is None
    assert s.kv_cache_bytes == 64 * 2**20
    decode_only = WorkerSettings.from_config(cfg, WorkerOverrides(engine="emulated", roles="decode"))  # fmt: skip
    assert (decode_only.device_class, decode_only.handoff_slots) == ("xpu", 0)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"roles": "prefill,encode"}, "--roles must be a comma list of prefill, decode"),
        ({"step_delay": 0.1}, "--step-delay is for the echo engine only"),
        ({"engine": "echo", "step_delay": -1.0}, "--step-delay must be >= 0"),
        ({"heartbeat_ttl": 1.0}, "--heartbeat-ttl must be at least 2 seconds"),
        ({"engine": "emulated", "device_class": "cpu"}, "serves the xPU class"),
    ],
)
def test_what_does_not_fit_is_refused_before_anything_loads(overrides, message):
    with pytest.raises(SettingsError, match=message):
        WorkerSettings.from_config(Config(), WorkerOverrides(**overrides))


# ---- build_engine: one engine core, the runner the settings name -----------------------------


def test_build_engine_has_a_builder_for_every_engine():
    assert set(build.BUILDERS) == set(ENGINES)


def test_build_engine_picks_the_echo_and_emulated_runners():
    echo = build_engine(WorkerSettings.from_config(Config(), WorkerOverrides(engine="echo", step_delay=0.01)))  # fmt: skip
    assert isinstance(echo, EchoEngine) and isinstance(echo.runner, EchoRunner)
    assert echo.step_delay == 0.01 and echo.tokenizer is not None
    emulated = build_engine(WorkerSettings.from_config(Config(), WorkerOverrides(engine="emulated", profile="a10")))  # fmt: skip
    assert isinstance(emulated, EmulatedEngine) and isinstance(emulated.runner, EmulatedRunner)
    assert emulated.runner.profile.name == "a10"


def test_build_engine_runs_the_model_with_the_workers_kernels():
    from syshax.workers.engine.engine import Engine
    from syshax.workers.engine.model_runner import ModelRunner
    from syshax.workers.engine.runner import FusedRunner

    cpu = dataclasses.replace(CPU, max_model_len=128, max_batch_size=2)
    engine = build_engine(WorkerSettings.from_config(Config(), cpu))
    assert isinstance(engine, Engine) and isinstance(engine.runner, ModelRunner)
    assert isinstance(engine.runner.forward, FusedRunner)  # the CPU default for a GGUF
    assert (engine.num_slots, engine.max_model_len) == (2, 128)
    assert engine.scheduler.prompt_rows_while_decoding == DEFAULT_CPU_PROMPT_ROWS_WHILE_DECODING


def test_build_engine_hands_vllm_its_arguments(monkeypatch):
    from syshax.workers.vllm import setup

    monkeypatch.setattr(setup, "build_engine", lambda *a: ("vllm", *a))
    echo = WorkerSettings.from_config(Config(), WorkerOverrides(engine="echo"))
    args = setup.worker_args(Config(), WorkerOverrides(), echo.engine_slots)
    made = build_engine(dataclasses.replace(echo, engine="vllm", vllm=args))
    assert made[0] == "vllm" and made[2] is args and made[3] == echo.served_model
