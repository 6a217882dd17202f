"""`syshax check-config`: load and check the config file; exit 1 when anything is wrong."""

from __future__ import annotations

import argparse
import sys

from syshax.commands.config import add_config_option
from syshax.shared import env
from syshax.shared.config import (
    ConfigError,
    load_config,
    redact_url,
    resolve_config_path,
    validate,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_option(p)


def run(args: argparse.Namespace) -> int:
    path = resolve_config_path(args.config)
    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        print(f"syshax check-config: error: {exc}", file=sys.stderr)
        return 1
    exists = path.exists()
    if exists:
        print(f"config: {path}")
    else:
        print(f"config: no file at {path}; using the built-in defaults (`syshax init` writes it)")
    try:
        print(f"model: {cfg.model} -> {cfg.model_path()} (served as {cfg.model_id})")
    except FileNotFoundError:
        print(f"model: {cfg.model} -> not found (served as {cfg.model_id})")
    kernels = _cpu_kernels_line(cfg)
    if kernels:
        print(kernels)
    xpu, profile_problems = _xpu_engine(cfg)
    print(xpu)
    print(_dispatch_line(cfg))
    if cfg.redis.url:
        print(f"redis: {redact_url(cfg.redis.url)}")
    else:
        print("redis: embedded (`syshax run` starts a Redis server on a free port)")
    problems = validate(cfg)
    for reader in env.ENV_VARS.values():
        try:
            reader()
        except env.EnvError as exc:
            problems.append(f"environment: {exc}")
    problems += _cpu_worker_problems(cfg) + profile_problems
    if problems:
        print(f"{len(problems)} problem(s):")
        for problem in problems:
            print(f"  - {problem}")
        return 1
    print(f"config OK: {path}" + ("" if exists else " (built-in defaults)"))
    return 0


def _xpu_engine(cfg) -> tuple[str, list[str]]:
    """The xPU worker's engine in words, and the problems of an emulated one's profile (it must
    load: a built-in name or a valid profile file) or of a vLLM one (vLLM importable in this
    Python, its settings, a Hugging Face model folder)."""
    if cfg.gpu.engine == "vllm":
        from syshax.commands import vllm_setup

        return vllm_setup.describe(cfg), vllm_setup.vllm_problems(cfg)
    if cfg.gpu.engine != "emulated":
        return f"xpu worker: the model on gpu.device {cfg.gpu.device}", []
    from syshax.workers.accelerator_profiles import ProfileError, load_profile

    try:
        profile = load_profile(cfg.gpu.profile)
    except ProfileError as exc:
        return "xpu worker: EMULATED accelerator, profile not loadable", [f"gpu.profile: {exc}"]
    return (
        f"xpu worker: EMULATED accelerator {profile.name!r} ({profile.description}): "
        "no model runs there, its text is meaningless",
        [],
    )


def _dispatch_line(cfg) -> str:
    device = cfg.decode_device
    if not cfg.auto_pd_offload:
        device = "xpu (auto_pd_offload false)"
    slo = "none" if cfg.slo.itl_ms is None else f"{cfg.slo.itl_ms:g} ms"
    used = "" if device == "auto" or cfg.slo.itl_ms is None else " (used with decode_device auto)"
    return f"decodes: decode_device {device}; inter-token latency SLO {slo}{used}"


def _cpu_worker_problems(cfg) -> list[str]:
    """CUSTOM_CPU_AFFINITY against the CPU workers' thread count, as `syshax worker` checks it."""
    from syshax.shared.config import resolve_threads
    from syshax.workers.cpu.affinity import AffinityError, resolve_affinity

    try:
        threads = env.omp_num_threads() or resolve_threads(cfg.cpu.threads)
    except env.EnvError:
        return []  # already reported with the other variables
    try:
        resolve_affinity(env.custom_cpu_affinity(), threads)
    except (env.EnvError, AffinityError) as exc:
        return [f"environment: {exc}"]
    return []


def _cpu_kernels_line(cfg) -> str | None:
    """What a CPU worker will run, by the default rule (workers/cpu/options.py), or None when
    the environment is invalid or the model is missing (reported as problems elsewhere)."""
    from syshax.workers.cpu.options import resolve_kernels
    from syshax.workers.engine.errors import EngineError

    try:
        quantize, op_mode = resolve_kernels(
            env.quantize(), env.inference_op_mode(), cfg.model_path(), "cpu"
        )
    except (env.EnvError, EngineError, FileNotFoundError):
        return None
    weights = {
        None: "float PyTorch weights",
        "stored": "the GGUF's own blocks as stored (native kernels)",
    }.get(quantize, f"requantized to {quantize} (native kernels)")
    step = "fused native decode step" if op_mode == "fused" else "PyTorch ops"
    why = "" if env.quantize() or env.inference_op_mode() else " (the default for this model)"
    return f"cpu workers: {weights}, {step}{why}; SYSHAX_QUANTIZE / INFERENCE_OP_MODE override"
