"""A worker's engine, built from its settings (settings.py): the engine core with the runner its
`engine` names (the model, the echo stand-in, the emulated accelerator) or vLLM's engine.

Every engine gets the worker's KV identity (the weights digest of its model and the name the
worker serves) and its engine slots (the decode slots plus the handoff slots)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from .engine.protocol import EngineProtocol
from .settings import WorkerSettings

log = logging.getLogger(__name__)


def build_engine(settings: WorkerSettings, tokenizer: Any = None) -> EngineProtocol:
    """The engine `settings.engine` names; raises EngineError (its message says why) when it
    cannot be built. vLLM is imported only for the vLLM engine, torch only by those that run
    a model or read one's shape. `tokenizer`: the model's, already loaded, for the stand-ins'
    text (the thread farm of the tests shares one); None = loaded from the model."""
    if tokenizer is not None and settings.engine in ("echo", "emulated"):
        return BUILDERS[settings.engine](settings, tokenizer)
    return BUILDERS[settings.engine](settings)


def _tokenizer(settings: WorkerSettings):
    """The model's tokenizer, for the stand-ins' text (their tokens are the prompt's)."""
    from syshax.shared.tokenizer import Tokenizer

    from .engine.loader import resolve_model_path

    return Tokenizer.from_model_path(resolve_model_path(settings.model))


def _native(s: WorkerSettings) -> EngineProtocol:
    from .engine.engine import Engine
    from .engine.model_runner import ModelOptions

    kernels = s.kernels.engine_kwargs() if s.kernels is not None else {}
    options = ModelOptions(
        device=s.device,
        dtype=s.dtype,
        max_model_len=s.max_model_len,
        max_num_seqs=s.engine_slots,
        max_num_batched_tokens=s.max_num_batched_tokens,
        kv_cache_bytes=s.kv_cache_bytes,
        prefix_caching=s.config.kv.prefix_caching,
        kv_dtype=kv_cache_dtype(s.config.kv.cache_dtype, s.kernels),
        prompt_rows_while_decoding=s.prompt_rows_while_decoding,
        prompt_stretch=s.prompt_stretch,
        served_model=s.served_model,
        speculative=s.speculative,
        **kernels,
    )
    return Engine(s.model, options)


def kv_cache_dtype(asked: str, kernels: Any) -> str | None:
    """The native engine's KV dtype from kv.cache_dtype (None: the engine's default). q8_0 is
    read by the fused CPU step alone: a worker without it (a GPU, float PyTorch weights) keeps
    its default rather than refusing to start in a farm whose CPU workers use it."""
    if asked == "auto":
        return None
    if asked == "q8_0" and (kernels is None or kernels.op_mode != "fused"):
        log.info("kv.cache_dtype q8_0 applies to the fused CPU step only: default KV dtype here")
        return None
    return asked


def _echo(s: WorkerSettings, tokenizer: Any = None) -> EngineProtocol:
    from .echo_engine import EchoEngine

    return EchoEngine(
        tokenizer or _tokenizer(s),
        max_model_len=s.max_model_len,
        max_num_seqs=s.engine_slots,
        max_num_batched_tokens=s.max_num_batched_tokens,
        step_delay=s.step_delay,
        served_model=s.served_model,
    )


def _emulated(s: WorkerSettings, tokenizer: Any = None) -> EngineProtocol:
    from .emulated_engine import EmulatedEngine

    return EmulatedEngine(
        s.model,
        s.profile,
        tokenizer or _tokenizer(s),
        max_model_len=s.max_model_len,
        max_num_seqs=s.engine_slots,
        max_num_batched_tokens=s.max_num_batched_tokens,
        prefix_caching=s.config.kv.prefix_caching,
        served_model=s.served_model,
    )


def _vllm(s: WorkerSettings) -> EngineProtocol:
    from .engine.loader import resolve_model_path
    from .vllm.setup import build_engine as build_vllm

    return build_vllm(resolve_model_path(s.model), s.vllm, s.served_model)


BUILDERS: dict[str, Callable[..., EngineProtocol]] = {
    "native": _native,
    "echo": _echo,
    "emulated": _emulated,
    "vllm": _vllm,
}
