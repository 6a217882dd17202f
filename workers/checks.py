"""What the workers will run with a config, and what keeps them from starting, said before
anything starts: `syshax check-config` prints `check_workers`, `syshax run` refuses to start
on `xpu_engine_problems` (a worker that cannot load its engine would only be restarted in a
loop). The rules are the workers' own (settings.py, farm_layout.py, cpu/options.py, vllm/setup.py). Light:
neither torch nor vLLM is imported."""

from __future__ import annotations

from dataclasses import dataclass, field

from syshax.shared import env
from syshax.shared.config import Config

from .farm_layout import cpu_threads


@dataclass
class WorkerReport:
    lines: list[str] = field(default_factory=list)  # what each kind of worker will run
    problems: list[str] = field(default_factory=list)


def check_workers(config: Config) -> WorkerReport:
    """The CPU workers' kernels and the xPU worker's engine in words, and their problems:
    CUSTOM_CPU_AFFINITY against the CPU workers' threads, the xPU engine's (an emulated
    accelerator's profile must load; vLLM must be importable here, with settings it takes and
    an HF model folder)."""
    report = WorkerReport()
    kernels = _cpu_kernels_line(config)
    if kernels:
        report.lines.append(kernels)
    report.lines.append(_describe_xpu(config))
    report.problems += _cpu_worker_problems(config)
    report.problems += xpu_engine_problems(config, config.xpu.engine)
    return report


def xpu_engine_problems(config: Config, engine: str) -> list[str]:
    """What keeps the xPU worker's `engine` from starting with this config."""
    if engine == "emulated":
        from .accelerator_profiles import ProfileError, load_profile

        try:
            load_profile(config.xpu.profile)
        except ProfileError as exc:
            return [f"xpu.profile: {exc}"]
    if engine == "vllm":  # vLLM here, its settings, an HF folder
        from .vllm.setup import vllm_problems

        return list(vllm_problems(config))
    return []


def _describe_xpu(config: Config) -> str:
    if config.xpu.engine == "vllm":
        from .vllm.setup import describe

        return describe(config)
    if config.xpu.engine != "emulated":
        return f"xpu worker: the model on xpu.device {config.xpu.device}"
    from .accelerator_profiles import ProfileError, load_profile

    try:
        profile = load_profile(config.xpu.profile)
    except ProfileError:
        return "xpu worker: EMULATED accelerator, profile not loadable"
    return (
        f"xpu worker: EMULATED accelerator {profile.name!r} ({profile.description}): "
        "no model runs there, its text is meaningless"
    )


def _cpu_worker_problems(config: Config) -> list[str]:
    """CUSTOM_CPU_AFFINITY against the CPU workers' thread count, as `syshax worker` checks it."""
    from .cpu.affinity import AffinityError, resolve_affinity

    try:
        threads = cpu_threads(config)
    except env.EnvError:
        return []  # already reported with the other variables
    try:
        resolve_affinity(env.custom_cpu_affinity(), threads)
    except (env.EnvError, AffinityError) as exc:
        return [f"environment: {exc}"]
    return []


def _cpu_kernels_line(config: Config) -> str | None:
    """What a CPU worker will run, by the default rule (cpu/options.py), or None when the
    environment is invalid or the model is missing (reported as problems elsewhere)."""
    from .cpu.options import resolve_kernels
    from .engine.errors import EngineError

    try:
        quantize, op_mode = resolve_kernels(
            env.quantize(), env.inference_op_mode(), config.model_path(), "cpu"
        )
    except (env.EnvError, EngineError, FileNotFoundError):
        return None
    weights = {
        None: "float PyTorch weights",
        "stored": "the GGUF's own blocks as stored (native kernels)",
    }.get(quantize, f"requantized to {quantize} (native kernels)")
    step = "fused native decode step" if op_mode == "fused" else "PyTorch ops"
    why = "" if env.quantize() or env.inference_op_mode() else " (the default for this model)"
    kv = _kv_cache_words(config.kv.cache_dtype, op_mode == "fused")
    return f"cpu workers: {weights}, {step}{why}; SYSHAX_QUANTIZE / INFERENCE_OP_MODE override; KV cache {kv}"  # fmt: skip


def _kv_cache_words(asked: str, fused: bool) -> str:
    """What the CPU workers' KV cache holds (build.kv_cache_dtype's rule), in words."""
    if fused:
        return "float16 (kv.cache_dtype auto)" if asked == "auto" else f"{asked} (kv.cache_dtype)"
    if asked == "q8_0":
        return "the model's dtype (kv.cache_dtype q8_0 needs the fused step)"
    return "the model's dtype (kv.cache_dtype auto)" if asked == "auto" else asked
