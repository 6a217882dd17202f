"""The engine: one model on one device, running many sequences with continuous batching.

The loop is vLLM v1's shape, in one process: `step()` = schedule (the torch-free `Scheduler`:
decode rows of running sequences, then prompt chunks, within a token budget) -> execute (the
runner: one native call on the CPU, see runner.py) -> sample -> update (detokenize, check
stops, free finished sequences' KV blocks). Sequences join and leave between steps. A sequence's KV cache
can be exported to a portable blob and imported into another engine (another process, device
or dtype) to continue decoding there.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from pathlib import Path

import torch
from syshax.shared.sampling import SamplingParams

from . import kv_format
from .errors import EngineError, RequestError
from .kv_cache import KVCache
from .kv_identity import KVIdentity
from .loader import WEIGHT_PLANS, is_gguf, load_model, parse_dtype, resolve_model_path
from .memory import available_bytes, plan_kv_blocks
from .outputs import EngineStats, StepOutput
from .protocol import PortableKV, SchedulerRequests
from .runner import FusedRunner, TorchRunner
from .sampler import sample
from .scheduler import DEFAULT_BLOCK_SIZE, DEFAULT_MAX_NUM_BATCHED_TOKENS, Scheduler

__all__ = ["Engine", "EngineStats", "StepOutput", "freeze_loaded_heap", "resolve_device"]

log = logging.getLogger(__name__)
DEFAULT_MAX_MODEL_LEN = 2048


def freeze_loaded_heap() -> None:
    """Move every object alive now (modules, weights' Python wrappers, the tokenizer) out of
    the garbage collector's generations, so the collections the decode loop triggers do not
    walk them: that was 2-4% of a CPU decode step at batch 1. For a process's entry point,
    once its engine is loaded (as vLLM does); never from library code, because cyclic
    garbage frozen with it is never freed."""
    gc.collect()
    gc.freeze()


def _position_limit(config) -> int:
    limit = config.max_position_embeddings
    if config.sliding_window:
        # Attention here is full; beyond the window it would differ from the model's.
        limit = min(limit, config.sliding_window)
    return limit


def _free_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return available_bytes()


def resolve_device(device: str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise EngineError("device 'cuda' was requested but torch sees no CUDA device")
    if dev.type not in ("cpu", "cuda"):
        raise EngineError(f"device {device!r} is not supported (cpu, cuda)")
    return dev


class Engine(SchedulerRequests, PortableKV):
    def __init__(
        self,
        model: str | Path | None = None,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        max_model_len: int | None = None,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int | None = None,
        load_tokenizer: bool = True,
        progress: bool = True,
        quantize: str | None = None,
        op_mode: str | None = None,
        nrc: int | None = None,
        kv_dtype: str | None = None,
        kv_cache_bytes: int | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        prefix_caching: bool = True,
        prompt_rows_while_decoding: int | None = None,
        served_model: str | None = None,
    ):
        """`quantize` and `op_mode` select the native CPU kernels (workers/cpu); None = plain
        PyTorch. `quantize`: "stored" runs a GGUF's own blocks as they are (Q4_0, Q4_1, Q8_0,
        Q4_K, Q5_K, Q6_K; the CPU default for GGUF, see workers/cpu/options.py), "q8_0" |
        "q4_0" quantize to that type. `op_mode` "fused" runs each decode step in one native
        call; `nrc` is the GEMM's row tile. `kv_dtype`: the KV cache's dtype (default: float16
        in fused mode, as llama.cpp does: attention reads half the bytes; else `dtype`).
        `max_num_batched_tokens`: the token rows one step computes at most (decodes plus
        prompt chunks; default 256, at least max_num_seqs). The KV cache is paged in blocks
        of `block_size` positions; `kv_cache_bytes` sizes it (default: see
        memory.plan_kv_blocks); `prefix_caching` shares computed prompt blocks.
        `prompt_rows_while_decoding`: the most prompt rows a step that also decodes takes
        (None: the rest of the budget; see the scheduler). `served_model`: the name the farm
        serves this model as (None: derived from the path, as the config does); with the
        weights digest it is the identity every exported KV blob carries and every imported
        one must have (kv_identity.py)."""
        self.device = resolve_device(device)
        if (quantize or op_mode) and self.device.type != "cpu":
            raise EngineError(
                "quantize/op_mode select the CPU kernels; this engine's device is "
                f"{self.device.type} (unset SYSHAX_QUANTIZE and INFERENCE_OP_MODE for it)"
            )
        if op_mode not in (None, "fused"):
            raise EngineError(f"op_mode {op_mode!r} is not valid; use 'fused' or None")
        if quantize not in (None, *WEIGHT_PLANS):
            raise EngineError(
                f"quantize {quantize!r} is not valid; use {', '.join(WEIGHT_PLANS)} or None"
            )
        self.dtype = parse_dtype(dtype)
        if max_num_seqs < 1:
            raise EngineError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        budget = max_num_batched_tokens or max(DEFAULT_MAX_NUM_BATCHED_TOKENS, max_num_seqs)
        if budget < max_num_seqs:
            raise EngineError(
                f"max_num_batched_tokens ({budget}) must be at least max_num_seqs "
                f"({max_num_seqs}): every running sequence decodes one row per step"
            )
        fused = op_mode == "fused"
        self.kv_dtype = (
            parse_dtype(kv_dtype) if kv_dtype else (torch.float16 if fused else self.dtype)
        )
        path = resolve_model_path(model)
        # A GGUF on the CPU is built straight into blocks; anything else loads as float first.
        in_blocks = quantize is not None and is_gguf(path)
        if quantize == "stored" and not in_blocks:
            log.info("%s: not a GGUF file, nothing to run as stored: float weights", path)
            quantize = None

        def kv_bytes(config) -> int:
            length = max_model_len or min(_position_limit(config), DEFAULT_MAX_MODEL_LEN)
            return KVCache.bytes_needed(config, max_num_seqs, length, self.kv_dtype)

        # Load at the model's size first so the rope table fits max_model_len.
        probe_len = max_model_len or DEFAULT_MAX_MODEL_LEN
        try:
            loaded = load_model(
                path,
                dtype=self.dtype,
                device=self.device,
                max_model_len=probe_len,
                progress=progress,
                weights=quantize if in_blocks else None,
                nrc=nrc or 0,
                kv_bytes=kv_bytes,
            )
        except (ValueError, RuntimeError) as exc:
            if not in_blocks:
                raise
            # the kernels refuse a shape (columns not whole blocks), or cannot be compiled
            raise EngineError(f"cannot load {path} for the CPU kernels: {exc}") from exc
        self.config = loaded.config
        self.model = loaded.model
        self.model_path = loaded.path
        # Once, at load: the header the loader just read is reused, plus ~256 KiB of samples.
        self.kv_identity = KVIdentity.of(self.model_path, served_model)
        self.quantize, self.op_mode = quantize, op_mode
        if quantize and not in_blocks:
            from syshax.workers.cpu.build import KernelBuildError
            from syshax.workers.cpu.quantized import quantize_model

            try:
                quantize_model(self.model, quantize, loaded.raw, nrc or 0)
            except (ValueError, KernelBuildError) as exc:
                raise EngineError(f"cannot quantize this model to {quantize}: {exc}") from exc
        del loaded
        limit = _position_limit(self.config)
        if max_model_len is None:
            max_model_len = min(limit, DEFAULT_MAX_MODEL_LEN)
        elif max_model_len > limit:
            raise EngineError(
                f"max_model_len {max_model_len} exceeds the model's limit of {limit} positions"
            )
        if max_model_len != probe_len:
            self.model.init_rope(max_model_len, self.device)
        self.max_model_len = max_model_len
        try:
            num_blocks = plan_kv_blocks(
                bytes_per_block=KVCache.bytes_per_block(self.config, block_size, self.kv_dtype),
                block_size=block_size,
                max_num_seqs=max_num_seqs,
                max_model_len=max_model_len,
                kv_cache_bytes=kv_cache_bytes,
                free_bytes=_free_bytes(self.device),
            )
        except ValueError as exc:
            raise EngineError(str(exc)) from exc
        self.cache = KVCache(
            self.config, num_blocks, block_size, self.kv_dtype, self.device, zero=not fused
        )
        self.fused = None
        self.runner: FusedRunner | TorchRunner = TorchRunner(self.model, self.cache, self.device)
        if op_mode == "fused":
            from syshax.workers.cpu.build import KernelBuildError
            from syshax.workers.cpu.fused import FusedDecoder, FusedError

            try:
                self.fused = FusedDecoder(self.model, self.cache, nrc=nrc or 0, max_tokens=budget)
            except (FusedError, KernelBuildError) as exc:
                raise EngineError(str(exc)) from exc
            self.runner = FusedRunner(self.fused)
        log.info(
            "KV cache: %d blocks x %d positions = %.1f MiB (%d sequences of %d positions)",
            num_blocks,
            block_size,
            self.cache.nbytes / 2**20,
            max_num_seqs,
            max_model_len,
        )
        self.tokenizer = None
        if load_tokenizer:
            from syshax.shared.tokenizer import Tokenizer

            self.tokenizer = Tokenizer.from_model_path(self.model_path)
        eos = set(self.config.eos_token_ids)
        if self.tokenizer is not None:
            eos.update(self.tokenizer.eos_token_ids)
        self.eos_token_ids = frozenset(eos)
        self.scheduler = Scheduler(
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            max_num_batched_tokens=budget,
            num_blocks=num_blocks,
            block_size=block_size,
            prefix_caching=prefix_caching,
            vocab_size=self.config.vocab_size,
            stop_token_ids=self.eos_token_ids,
            tokenizer=self.tokenizer,
            prompt_rows_while_decoding=prompt_rows_while_decoding,
        )
        self.stats = EngineStats()

    # ---- requests (the engine protocol, see protocol.py) --------------------------------

    @property
    def model_id(self) -> str:
        return self.config.fingerprint()

    # ---- the loop -----------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        step = self.scheduler.schedule()
        if not step.chunks:
            return []
        start = time.perf_counter()
        decode_rows = step.decode_rows
        logits = self.runner.execute(step)
        chunks = step.sampling
        tokens: list[int] = []
        logprobs: list[float | None] = []
        if chunks:
            tokens, logprobs = sample(
                logits, [c.seq.params for c in chunks], [len(c.seq.output_ids) for c in chunks]
            )
        self._sync()
        self.stats.record(step.num_rows - decode_rows, decode_rows, time.perf_counter() - start)
        return self.scheduler.update(step, tokens, logprobs)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- KV movement --------------------------------------------------------------------

    def export_kv(self, request_id: str, release: bool = True) -> bytes:
        """The request's KV cache as a portable blob; `release` frees it here (the usual handoff)."""
        seq = self.scheduler.sequences.get(request_id)
        if seq is None or not seq.block_table or seq.length - seq.num_cached != 1:
            raise RequestError(f"request {request_id!r} has no KV cache in this engine")
        keys, values = self.cache.read(seq.block_table, seq.num_cached)
        blob = kv_format.encode(
            self.config, keys, values, seq.output_ids[-1], identity=self.kv_identity
        )
        if release:
            self.abort(request_id)
        return blob

    def import_kv(
        self,
        request_id: str,
        blob: bytes | memoryview,
        prompt_ids: Seq[int],
        output_ids: Seq[int],
        params: SamplingParams,
    ) -> None:
        """Continue a request from a KV blob made by `export_kv` (any process, device or dtype)."""
        header, keys, values = kv_format.decode(blob)
        header.check_compatible(self.config, self.kv_identity)
        header.check_request(prompt_ids, output_ids)
        seq = self.scheduler.new_sequence(request_id, prompt_ids, params, output_ids)
        self.scheduler.add_running(seq, header.num_tokens)
        try:
            self.cache.write(seq.block_table, keys.to(self.device), values.to(self.device))
        except Exception:
            self.scheduler.abort(request_id)  # never keep blocks whose cache was not filled
            raise

    # ---- convenience --------------------------------------------------------------------

    def generate(
        self, prompt_ids: Seq[int], params: SamplingParams, request_id: str = "gen"
    ) -> Iterator[StepOutput]:
        """Run one request to the end, yielding each token (other requests keep running too)."""
        self.add_request(request_id, prompt_ids, params)
        while True:
            for out in self.step():
                if out.request_id == request_id:
                    yield out
                    if out.finished:
                        return
