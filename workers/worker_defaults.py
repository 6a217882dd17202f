"""The values a worker setting takes when neither the config nor the command line gives one,
each by its rule (docs/configuration.md): device, threads, native kernels, handoff slots,
speculative decoding, prompt rows while decoding. `WorkerSettings.from_config`
(settings.py) asks; only resolving `xpu.device: auto` imports torch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from syshax.shared.config import Config, resolve_threads
from syshax.shared.config_schema import (
    DEFAULT_CPU_PROMPT_ROWS_WHILE_DECODING,
    DEFAULT_CPU_PROMPT_STRETCH,
)

from .farm_layout import cpu_threads, xpu_threads

# Engines that are an accelerator whatever device this host has: they serve the xPU class.
ACCELERATORS = ("emulated", "vllm")
ROLES = frozenset({"prefill", "decode"})


def device_of(config: Config, asked: str | None, engine: str, cls: str, profile) -> str:
    """The device the worker runs and reports: vLLM picks its own, an emulated accelerator is
    named for its profile (what the heartbeat and the token events show). `asked`: --device."""
    if engine == "vllm":
        return f"vllm:{resolve_device('auto')}"
    if profile is not None:
        return f"emulated:{profile.name}"
    return resolve_device(asked or (config.xpu.device if cls == "xpu" else "cpu"))


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch  # the one question only torch answers: is there a CUDA device?

    return "cuda" if torch.cuda.is_available() else "cpu"


def threads_of(config: Config, asked: int | None, engine: str, cls: str) -> int:
    """--threads; a CPU decode worker's `cpu_threads`; the xPU class: every core when it is
    the farm's only worker (`xpu_threads`, as `syshax run` lays it out), else xpu.threads
    (null = half the cores)."""
    if asked:
        return asked
    if cls == "cpu":
        return cpu_threads(config)
    return xpu_threads(config, engine) or resolve_threads(config.xpu.threads)


def kernel_options(cls: str, device: str, threads: int, engine: str, model: str):
    """The native kernels' options for a model worker on a CPU device, checked before loading
    and resolved by the default rule (workers/cpu/options.py: a GGUF runs its own blocks with
    the fused step); None for GPU, echo and accelerator workers. CUSTOM_CPU_AFFINITY pins
    CPU-class workers only (an xPU-role worker on a CPU-only host shares the cores unpinned)."""
    if device != "cpu" or engine != "native":
        return None
    from .cpu.options import from_env

    opts = from_env(threads)
    if cls != "cpu":
        opts = dataclasses.replace(opts, cpus=None)
    return opts.resolved(model, device)


def handoff_slots(config: Config, engine: str, cls: str, device: str, roles: frozenset[str]) -> int:
    """One engine slot beyond the decode slots for an accelerator that prefills and decodes
    in a farm that may offload decode: a prompt is prefilled there for the CPU while every
    decode slot is busy (WorkerOptions.handoff_slots). Not for the xPU role on a CPU (the
    farm without an accelerator has no CPU decoders to offload to)."""
    accelerator = engine in ACCELERATORS or device != "cpu"
    offloads = config.auto_pd_offload and config.decode_device == "auto"
    return int(cls == "xpu" and accelerator and offloads and roles >= ROLES)


def speculative(config: Config, engine: str) -> Any:
    """The native engine's speculative decoding (a SpecConfig), None when off or another
    engine runs (vLLM has its own; the stand-ins compute nothing to verify)."""
    section = config.speculative
    if engine != "native" or section.method == "none":
        return None
    from .engine.speculative import SpecConfig

    draft = section.draft_model if section.method == "draft" else None
    return SpecConfig(
        method=section.method, num_tokens=section.num_tokens, draft_model=draft
    ).check()


def prompt_rows_while_decoding(config: Config, device: str) -> int | None:
    """The config's value; null = a cap on a CPU engine (whose prompt rows cost a running
    stream ~5 ms each at 1B on 2 cores), none on an accelerator (where they cost microseconds
    and a smaller chunk only slows the prefill)."""
    if config.prompt_rows_while_decoding is not None:
        return config.prompt_rows_while_decoding
    return DEFAULT_CPU_PROMPT_ROWS_WHILE_DECODING if device == "cpu" else None


def prompt_stretch(config: Config, device: str) -> float | None:
    """The config's value; null = the time rule on a CPU engine (its prompt rows cost a
    stream's gap in proportion), none on an accelerator (a flat step: the cap alone)."""
    if config.prompt_stretch is not None:
        return config.prompt_stretch
    return DEFAULT_CPU_PROMPT_STRETCH if device == "cpu" else None
