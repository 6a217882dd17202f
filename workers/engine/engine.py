"""The engine: one model on one device, running many sequences with continuous batching.

The loop is vLLM v1's shape, in one process: `step()` = schedule (prefill one waiting
sequence if a slot is free, else decode every running one) -> execute (one model call) ->
update (sample, detokenize, check stops, free finished slots). Sequences join and leave
between steps. A sequence's KV cache can be exported to a portable blob and imported into
another engine (another process, device or dtype) to continue decoding there.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from collections import deque
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path

import torch
from syshax.shared.sampling import SamplingParams

from . import kv_format
from .errors import CapacityError, EngineError, RequestError
from .kv_cache import KVCache
from .loader import WEIGHT_PLANS, is_gguf, load_model, parse_dtype, resolve_model_path
from .sampler import sample
from .sequence import Sequence, SlotTable, make_detokenizer, record_token

log = logging.getLogger(__name__)
DEFAULT_MAX_MODEL_LEN = 2048


@dataclass
class StepOutput:
    request_id: str
    token_id: int
    text: str  # new text safe to show (may be "" while a UTF-8 char or a stop string is pending)
    logprob: float | None
    index: int  # 0-based index of this token in the request's output
    finish_reason: str | None = None  # "stop" | "length" | None while running

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class EngineStats:
    """Timings measured inside the engine (model load excluded), like llama.cpp's timings."""

    prompt_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    decode_steps: int = 0
    recent: deque = field(default_factory=lambda: deque(maxlen=64))  # (tokens, seconds) per step

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def recent_decode_tps(self) -> float:
        """Decode tokens/s over the last steps: what a dispatcher wants to know now."""
        toks = sum(t for t, _ in self.recent)
        secs = sum(s for _, s in self.recent)
        return toks / secs if secs else 0.0


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


def resolve_device(device: str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise EngineError("device 'cuda' was requested but torch sees no CUDA device")
    if dev.type not in ("cpu", "cuda"):
        raise EngineError(f"device {device!r} is not supported (cpu, cuda)")
    return dev


class Engine:
    def __init__(
        self,
        model: str | Path | None = None,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        max_model_len: int | None = None,
        max_num_seqs: int = 16,
        load_tokenizer: bool = True,
        progress: bool = True,
        quantize: str | None = None,
        op_mode: str | None = None,
        nrc: int | None = None,
        kv_dtype: str | None = None,
    ):
        """`quantize` and `op_mode` select the native CPU kernels (workers/cpu); None = plain
        PyTorch. `quantize`: "stored" runs a GGUF's own blocks as they are (Q4_0, Q4_1, Q8_0,
        Q4_K, Q5_K, Q6_K; the CPU default for GGUF, see workers/cpu/options.py), "q8_0" |
        "q4_0" quantize to that type. `op_mode` "fused" runs each decode step in one native
        call; `nrc` is the GEMM's row tile. `kv_dtype`: the KV cache's dtype (default: float16
        in fused mode, as llama.cpp does: attention reads half the bytes; else `dtype`)."""
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
        self.cache = KVCache(
            self.config, max_num_seqs, max_model_len, self.kv_dtype, self.device, zero=not fused
        )
        self.fused = None
        if op_mode == "fused":
            from syshax.workers.cpu.build import KernelBuildError
            from syshax.workers.cpu.fused import FusedDecoder, FusedError

            try:
                self.fused = FusedDecoder(self.model, self.cache, nrc=nrc or 0)
            except (FusedError, KernelBuildError) as exc:
                raise EngineError(str(exc)) from exc
        log.info(
            "KV cache: %d slots x %d positions = %.1f MiB",
            max_num_seqs,
            max_model_len,
            self.cache.nbytes / 2**20,
        )
        self.tokenizer = None
        if load_tokenizer:
            from syshax.shared.tokenizer import Tokenizer

            self.tokenizer = Tokenizer.from_model_path(self.model_path)
        eos = set(self.config.eos_token_ids)
        if self.tokenizer is not None:
            eos.update(self.tokenizer.eos_token_ids)
        self.eos_token_ids = frozenset(eos)
        self.slots = SlotTable(max_num_seqs)
        self.waiting: deque[Sequence] = deque()
        self.sequences: dict[str, Sequence] = {}
        self.stats = EngineStats()

    # ---- requests -----------------------------------------------------------------------

    @property
    def model_id(self) -> str:
        return self.config.fingerprint()

    def add_request(self, request_id: str, prompt_ids: Seq[int], params: SamplingParams) -> None:
        """Queue a request for prefill; `step()` will run it when a slot is free."""
        self._check_new(request_id, prompt_ids, params)
        seq = Sequence(request_id, list(prompt_ids), params)
        seq.detokenizer = self._detokenizer(seq)
        self.sequences[request_id] = seq
        self.waiting.append(seq)

    def resume_request(
        self, request_id: str, prompt_ids: Seq[int], output_ids: Seq[int], params: SamplingParams
    ) -> None:
        """Continue a request whose KV is lost (its worker died): recompute it from the tokens."""
        self._check_new(request_id, prompt_ids, params)
        seq = Sequence(request_id, list(prompt_ids), params, output_ids=list(output_ids))
        seq.logprobs = [None] * len(seq.output_ids)
        seq.detokenizer = self._detokenizer(seq)
        self.sequences[request_id] = seq
        self.waiting.append(seq)

    def _check_new(self, request_id: str, prompt_ids: Seq[int], params: SamplingParams) -> None:
        if request_id in self.sequences:
            raise RequestError(f"request {request_id!r} is already in this engine")
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise RequestError(
                f"prompt has {len(prompt_ids)} tokens; max_model_len is {self.max_model_len} "
                "(the prompt must leave room for at least one generated token)"
            )
        bad = [t for t in prompt_ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise RequestError(
                f"token id {bad[0]} is outside the vocabulary (size {self.config.vocab_size})"
            )
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer; this engine was loaded without one")

    def _detokenizer(self, seq: Sequence):
        return make_detokenizer(self.tokenizer, seq)

    def abort(self, request_id: str) -> None:
        """Drop a request wherever it is (waiting or running) and free its slot."""
        seq = self.sequences.pop(request_id, None)
        if seq is None:
            return
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif seq.slot >= 0:
            self._free_slot(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or len(self.slots))

    @property
    def num_running(self) -> int:
        return len(self.slots)

    # ---- the loop -----------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        if self.waiting and self.slots.has_free:
            return [self._prefill(self.waiting.popleft())]
        if len(self.slots):
            return self._decode()
        return []

    def _prefill(self, seq: Sequence) -> StepOutput:
        self.slots.add(seq)
        ids = seq.all_ids
        start = time.perf_counter()
        tokens = torch.tensor(ids, dtype=torch.long, device=self.device)
        logits = self.model.prefill(tokens, self.cache, seq.slot)
        seq.num_cached = len(ids)
        (token,), (lp,) = sample(logits[None], [seq.params], [len(seq.output_ids)])
        self._sync()
        self.stats.prompt_tokens += len(ids)
        self.stats.prefill_seconds += time.perf_counter() - start
        return self._update(seq, token, lp)

    def _decode(self) -> list[StepOutput]:
        running = list(self.slots.running)
        start = time.perf_counter()
        token_list = [s.output_ids[-1] for s in running]
        pos_list = [s.num_cached for s in running]
        if self.fused is not None:
            logits = self.fused.decode(token_list, pos_list)
        else:
            logits = self._torch_decode(token_list, pos_list)
        for s in running:
            s.num_cached += 1
        new_tokens, lps = sample(
            logits, [s.params for s in running], [len(s.output_ids) for s in running]
        )
        self._sync()
        elapsed = time.perf_counter() - start
        self.stats.decode_tokens += len(running)
        self.stats.decode_seconds += elapsed
        self.stats.decode_steps += 1
        self.stats.recent.append((len(running), elapsed))
        return [self._update(s, t, lp) for s, t, lp in zip(running, new_tokens, lps, strict=True)]

    def _torch_decode(self, token_list: list[int], pos_list: list[int]) -> torch.Tensor:
        dev = self.device
        tokens = torch.tensor(token_list, dtype=torch.long, device=dev)
        positions = torch.tensor(pos_list, dtype=torch.long, device=dev)
        length = max(pos_list) + 1
        visible = torch.arange(length, device=dev)[None, :] <= positions[:, None]
        mask = torch.zeros(visible.shape, dtype=torch.float32, device=dev)
        mask.masked_fill_(~visible, float("-inf"))
        return self.model.decode(tokens, positions, mask[:, None, None, :], self.cache)

    def _update(self, seq: Sequence, token: int, logprob: float | None) -> StepOutput:
        seq.logprobs.append(logprob)
        text = record_token(seq, token, self.eos_token_ids, self.max_model_len)
        if seq.finish_reason is not None:
            self._free_slot(seq)
            self.sequences.pop(seq.request_id, None)
        index = len(seq.output_ids) - 1
        return StepOutput(seq.request_id, token, text, logprob, index, seq.finish_reason)

    def _free_slot(self, seq: Sequence) -> None:
        move = self.slots.remove(seq)
        if move is not None:
            self.cache.move(*move)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- KV movement --------------------------------------------------------------------

    def export_kv(self, request_id: str, release: bool = True) -> bytes:
        """The request's KV cache as a portable blob; `release` frees it here (the usual handoff)."""
        seq = self.sequences.get(request_id)
        if seq is None or seq.slot < 0:
            raise RequestError(f"request {request_id!r} has no KV cache in this engine")
        keys, values = self.cache.read(seq.slot, seq.num_cached)
        blob = kv_format.encode(self.config, keys, values, next_token=seq.output_ids[-1])
        if release:
            self.abort(request_id)
        return blob

    def describe_kv(self, blob: bytes | memoryview) -> dict:
        """The blob's header fields (for the KV handle that records where it waits)."""
        header, _ = kv_format.decode_header(blob)
        return dataclasses.asdict(header)

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
        header.check_compatible(self.config)
        if header.num_tokens != len(prompt_ids) + len(output_ids) - 1 or (
            not output_ids or header.next_token != output_ids[-1]
        ):
            raise kv_format.KVFormatError(
                f"KV blob holds {header.num_tokens} tokens with next token {header.next_token}; "
                f"the request has {len(prompt_ids)} prompt + {len(output_ids)} output tokens"
            )
        self._check_new(request_id, prompt_ids, params)
        if not self.slots.has_free:
            raise CapacityError(f"all {self.slots.num_slots} sequence slots are in use")
        seq = Sequence(request_id, list(prompt_ids), params, output_ids=list(output_ids))
        seq.logprobs = [None] * len(seq.output_ids)
        seq.detokenizer = self._detokenizer(seq)
        self.slots.add(seq)
        self.cache.write(seq.slot, keys.to(self.device), values.to(self.device))
        seq.num_cached = header.num_tokens
        self.sequences[request_id] = seq

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
