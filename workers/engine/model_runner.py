"""The model runner: a loaded model, its paged KV cache and a forward, behind the engine core.

Built in two parts: `ModelOptions` (the engine's keyword arguments) is made concrete and
checked by `plan_load` before any weight is read, so a bad option fails in a second, not
after a minute of loading; `ModelRunner.load` then loads the weights (as the GGUF's own
blocks for the CPU kernels, or as float), fits the context length to the model, sizes the
KV cache and picks the forward: one native call per step (`FusedRunner`, op_mode "fused")
or PyTorch (`TorchRunner`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import kv_format
from .config import DEFAULT_MAX_MODEL_LEN, read_model_config
from .core import ImportedKV, Sampled
from .errors import EngineError
from .kv_cache import Q8_0, KVCache, KVDType, check_fits, dtype_name
from .kv_identity import KVIdentity
from .loader import (
    WEIGHT_PLANS,
    LoadedModel,
    is_gguf,
    load_model,
    parse_dtype,
    resolve_model_path,
)
from .memory import available_bytes, plan_kv_blocks
from .prompt_budget import PromptBudget
from .protocol import PortableKV
from .runner import FusedRunner, TorchRunner
from .sampler import sample_sequences
from .scheduled_step import ScheduledStep, step_budget
from .scheduler import DEFAULT_BLOCK_SIZE
from .sequence import Sequence
from .spec_verify import sample_step
from .speculative import SpecConfig

log = logging.getLogger(__name__)


@dataclass
class ModelOptions:
    """How a model engine loads and runs its model (`Engine(model, **options)`).

    `quantize` and `op_mode` select the native CPU kernels (workers/cpu); None = plain
    PyTorch. `quantize`: "stored" runs a GGUF's own blocks as they are (Q4_0, Q4_1, Q8_0,
    Q4_K, Q5_K, Q6_K; the CPU default for GGUF, see workers/cpu/options.py), "q8_0" | "q4_0"
    quantize to that type. `op_mode` "fused" runs each step in one native call; `nrc` is the
    GEMM's row tile. `kv_dtype`: the KV cache's dtype (default: float16 in fused mode, as
    llama.cpp does: attention reads half the bytes; else `dtype`). `max_model_len`: None =
    the model's limit, at most DEFAULT_MAX_MODEL_LEN. `max_num_batched_tokens`: the token rows
    one step computes at most (decodes plus prompt chunks; default 256, at least
    max_num_seqs). The KV cache is paged in blocks of `block_size` positions;
    `kv_cache_bytes` sizes it (default: see memory.plan_kv_blocks); `prefix_caching` shares
    computed prompt blocks. `prompt_rows_while_decoding`: the most prompt rows a step that
    also decodes takes (None: the rest of the budget; see the scheduler); `prompt_stretch`:
    how much longer than its decodes alone such a step may run (prompt_budget.py; None: the
    cap alone). `served_model`: the
    name the farm serves this model as (None: derived from the path, as the config does);
    with the weights digest it is the identity every exported KV blob carries and every
    imported one must have (kv_identity.py). `speculative`: speculative decoding's settings
    (speculative.py; None: off)."""

    device: str = "cpu"
    dtype: str = "float32"
    max_model_len: int | None = None
    max_num_seqs: int = 16
    max_num_batched_tokens: int | None = None
    load_tokenizer: bool = True
    progress: bool = True
    quantize: str | None = None
    op_mode: str | None = None
    nrc: int | None = None
    kv_dtype: str | None = None
    kv_cache_bytes: int | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    prefix_caching: bool = True
    prompt_rows_while_decoding: int | None = None
    prompt_stretch: float | None = None
    served_model: str | None = None
    speculative: SpecConfig | None = None


@dataclass
class LoadPlan:
    """The options made concrete and checked, before anything is loaded."""

    path: Path
    device: torch.device
    dtype: torch.dtype
    kv_dtype: KVDType  # a torch dtype, or kv_cache.Q8_0
    quantize: str | None
    op_mode: str | None
    budget: int  # the step's token rows (the scheduler's, and the fused step's buffers)

    @property
    def in_blocks(self) -> bool:
        """A GGUF for the CPU kernels is built straight into blocks; the rest loads as float."""
        return self.quantize is not None and is_gguf(self.path)


def resolve_device(device: str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise EngineError("device 'cuda' was requested but torch sees no CUDA device")
    if dev.type not in ("cpu", "cuda"):
        raise EngineError(f"device {device!r} is not supported (cpu, cuda)")
    return dev


def plan_load(model: str | Path | None, opts: ModelOptions) -> LoadPlan:
    """`opts` checked (EngineError, ValueError for a dtype) and made concrete for `model`."""
    device = resolve_device(opts.device)
    quantize, op_mode = opts.quantize, opts.op_mode
    if (quantize or op_mode) and device.type != "cpu":
        raise EngineError(
            "quantize/op_mode select the CPU kernels; this engine's device is "
            f"{device.type} (unset SYSHAX_QUANTIZE and INFERENCE_OP_MODE for it)"
        )
    if op_mode not in (None, "fused"):
        raise EngineError(f"op_mode {op_mode!r} is not valid; use 'fused' or None")
    if quantize not in (None, *WEIGHT_PLANS):
        raise EngineError(
            f"quantize {quantize!r} is not valid; use {', '.join(WEIGHT_PLANS)} or None"
        )
    dtype = parse_dtype(opts.dtype)
    try:
        budget = step_budget(
            opts.max_num_seqs, opts.max_num_batched_tokens, opts.prompt_rows_while_decoding
        )
        PromptBudget(opts.prompt_rows_while_decoding, opts.prompt_stretch)  # checks both
        if opts.speculative is not None:
            opts.speculative.check()
    except ValueError as exc:
        raise EngineError(str(exc)) from None
    fused = op_mode == "fused"
    kv_dtype = _kv_dtype(opts.kv_dtype, fused, dtype)
    plan = LoadPlan(resolve_model_path(model), device, dtype, kv_dtype, quantize, op_mode, budget)
    if kv_dtype == Q8_0:  # a head_dim that is not whole blocks fails now, not after the load
        try:
            check_fits(read_model_config(plan.path), kv_dtype, device)
        except ValueError as exc:
            raise EngineError(str(exc)) from None
    if quantize == "stored" and not plan.in_blocks:
        log.info("%s: not a GGUF file, nothing to run as stored: float weights", plan.path)
        plan.quantize = None
    return plan


def _kv_dtype(asked: str | None, fused: bool, dtype: torch.dtype) -> KVDType:
    """The KV cache's dtype: as asked, else float16 in fused mode (llama.cpp's default) and the
    model's dtype in PyTorch. q8_0 is read by the native kernels alone."""
    if asked == Q8_0:
        if not fused:
            raise EngineError(
                "a q8_0 KV cache needs the fused CPU step (a GGUF or SYSHAX_QUANTIZE on the "
                "CPU, INFERENCE_OP_MODE not none); use float16 here"
            )
        return Q8_0
    return parse_dtype(asked) if asked else (torch.float16 if fused else dtype)


class ModelRunner(PortableKV):
    timing = "compute"

    def __init__(
        self,
        plan: LoadPlan,
        loaded: LoadedModel,
        cache: KVCache,
        max_model_len: int,
        served_model: str | None,
        nrc: int,
    ) -> None:
        self.device, self.dtype, self.kv_dtype = plan.device, plan.dtype, plan.kv_dtype
        self.quantize, self.op_mode = plan.quantize, plan.op_mode
        self.config, self.model, self.model_path = loaded.config, loaded.model, loaded.path
        self.cache, self.max_model_len = cache, max_model_len
        # Once, at load: the header the loader just read is reused, plus ~256 KiB of samples.
        self.kv_identity = KVIdentity.of(self.model_path, served_model)
        self.fused = None
        # llguidance's view of the tokenizer, for structured outputs; the engine sets it when
        # it loads one (None: a constrained request fails with a clear error).
        self.ll_tokenizer: Callable[[], Any] | None = None
        self.forward: FusedRunner | TorchRunner = TorchRunner(self.model, cache, self.device)
        if plan.op_mode == "fused":
            from syshax.workers.cpu.build import KernelBuildError
            from syshax.workers.cpu.fused import FusedDecoder, FusedError

            try:
                self.fused = FusedDecoder(self.model, cache, nrc=nrc, max_tokens=plan.budget)
            except (FusedError, KernelBuildError) as exc:
                raise EngineError(str(exc)) from exc
            self.forward = FusedRunner(self.fused)
            log.info("fused CPU step: kernels %s, %d threads", self.fused.simd, self.fused.threads)

    @classmethod
    def load(cls, model: str | Path | None, opts: ModelOptions) -> ModelRunner:
        plan = plan_load(model, opts)
        from .draft_memory import draft_footprint

        draft = draft_footprint(opts, plan.kv_dtype)  # loaded after, counted before
        loaded = _load_weights(plan, opts, draft)
        config = loaded.config
        max_model_len = config.context_length(opts.max_model_len)
        if max_model_len != (opts.max_model_len or DEFAULT_MAX_MODEL_LEN):
            loaded.model.init_rope(max_model_len, plan.device)  # loaded for the probe length
        cache = _kv_cache(plan, opts, config, max_model_len, draft)
        return cls(plan, loaded, cache, max_model_len, opts.served_model, opts.nrc or 0)

    @property
    def model_id(self) -> str:
        return self.config.fingerprint()

    # ---- the step -----------------------------------------------------------------------

    def execute(self, step: ScheduledStep, started: float) -> Sampled:
        logits = self.forward.execute(step)
        chunks = step.sampling
        sampled = Sampled([], [])
        if any(c.draft for c in chunks):
            sampled = sample_step(logits, chunks, self.ll_tokenizer)
        elif chunks:
            sampled = sample_sequences(logits, [c.seq for c in chunks], self.ll_tokenizer)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the step's time is the device's too
        return sampled

    def finish(self, outputs) -> None:
        return None

    def prompt_logits(self, token_ids: list[int], table: list[int], first: int) -> torch.Tensor:
        """The logits [len(token_ids) - first, vocab] (fp32, CPU) of every position from
        `first` on of a sequence computed from position 0 in blocks `table`: what perplexity
        scores (a step samples only each chunk's last row)."""
        return self.forward.prompt_logits(token_ids, table, first)

    # ---- KV -----------------------------------------------------------------------------

    def export_kv(self, seq: Sequence) -> bytes:
        keys, values = self.cache.read(seq.block_table, seq.num_cached)
        return kv_format.encode(
            self.config, keys, values, seq.output_ids[-1], identity=self.kv_identity
        )

    def read_kv(self, blob, prompt_ids, output_ids) -> ImportedKV:
        header, keys, values = kv_format.checked(
            blob, self.config, self.kv_identity, prompt_ids, output_ids
        )
        return ImportedKV(header.num_tokens, keys, values)

    def write_kv(self, seq: Sequence, kv: ImportedKV) -> None:
        self.cache.write(seq.block_table, kv.keys.to(self.device), kv.values.to(self.device))


def _load_weights(plan: LoadPlan, opts: ModelOptions, draft: Any = None) -> LoadedModel:
    """The model at `plan.path`, loaded at the asked context length (or the default, when the
    model allows more: refitted after), quantized when asked and not built in blocks. The
    memory check counts `draft` (a DraftFootprint) too: its weights and KV pool."""

    def length(config) -> int:
        return opts.max_model_len or min(config.position_limit, DEFAULT_MAX_MODEL_LEN)

    def kv_bytes(config) -> int:
        return KVCache.bytes_needed(config, opts.max_num_seqs, length(config), plan.kv_dtype)

    def draft_bytes(config) -> tuple[int, int]:
        kv = draft.kv_bytes(opts.max_num_seqs, length(config), plan.kv_dtype)
        return draft.weights, kv

    in_blocks, nrc = plan.in_blocks, opts.nrc or 0
    try:
        loaded = load_model(
            plan.path,
            dtype=plan.dtype,
            device=plan.device,
            max_model_len=opts.max_model_len or DEFAULT_MAX_MODEL_LEN,
            progress=opts.progress,
            weights=plan.quantize if in_blocks else None,
            nrc=nrc,
            kv_bytes=kv_bytes,
            draft_bytes=draft_bytes if draft is not None else None,
        )
    except (ValueError, RuntimeError) as exc:
        if not in_blocks:
            raise
        # the kernels refuse a shape (columns not whole blocks), or cannot be compiled
        raise EngineError(f"cannot load {plan.path} for the CPU kernels: {exc}") from exc
    if plan.quantize and not in_blocks:
        from syshax.workers.cpu.build import KernelBuildError
        from syshax.workers.cpu.quantized import quantize_model

        try:
            quantize_model(loaded.model, plan.quantize, loaded.raw, nrc)
        except (ValueError, KernelBuildError) as exc:
            raise EngineError(f"cannot quantize this model to {plan.quantize}: {exc}") from exc
    loaded.raw = {}  # the float GGUF's blocks were only for quantize_model
    return loaded


def _kv_cache(
    plan: LoadPlan, opts: ModelOptions, config, max_model_len: int, draft: Any = None
) -> KVCache:
    """The paged KV cache: `opts.kv_cache_bytes`, or room for every sequence at
    max_model_len within a share of the free memory (memory.plan_kv_blocks). With a draft
    model (a DraftFootprint), whose pool gets as many blocks, that share holds both pools
    and its weights, loaded after, are not free memory."""
    block_size = opts.block_size
    cuda = plan.device.type == "cuda"
    free = torch.cuda.mem_get_info(plan.device)[0] if cuda else available_bytes()
    per_block = KVCache.bytes_per_block(config, block_size, plan.kv_dtype)
    if draft is not None and opts.kv_cache_bytes is None:
        per_block += draft.bytes_per_block
        free = None if free is None else max(free - draft.weights, 0)
    try:
        num_blocks = plan_kv_blocks(
            bytes_per_block=per_block,
            block_size=block_size,
            max_num_seqs=opts.max_num_seqs,
            max_model_len=max_model_len,
            kv_cache_bytes=opts.kv_cache_bytes,
            free_bytes=free,
        )
    except ValueError as exc:
        raise EngineError(str(exc)) from exc
    # The fused step fills the cache itself (NUMA placement, or first touch): no zeroing.
    fused = plan.op_mode == "fused"
    try:
        cache = KVCache(config, num_blocks, block_size, plan.kv_dtype, plan.device, zero=not fused)
    except ValueError as exc:  # a q8_0 cache the model's head_dim does not fit
        raise EngineError(str(exc)) from None
    log.info(
        "KV cache: %d blocks x %d positions = %.1f MiB of %s (%d sequences of %d positions)",
        num_blocks,
        block_size,
        cache.nbytes / 2**20,
        dtype_name(plan.kv_dtype),
        opts.max_num_seqs,
        max_model_len,
    )
    return cache
