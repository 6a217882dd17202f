"""An emulated accelerator: the engine protocol, the real scheduler, a GPU's step times, no GPU.

Each step sleeps for the time an accelerator profile (accelerator_profiles.py) predicts for
its prompt rows, decode rows and KV context, scaled to the farm's model, so the process uses
no CPU while it "computes" and the CPU decode workers keep the cores, as on a GPU host.
Tokens are deterministic (output token i of a request is prompt token i, cycling, as in the
echo stand-in) and the text is meaningless: the first text of every request it starts says
so, and a warning is logged at construction. A sequence handed off to a CPU worker carries a
KV blob in the real engine's format and the real model's shape (zeros for contents), so the
CPU worker imports it and decodes at real cost.

The module imports without torch; construction reads the model's config through the engine's
loaders and `export_kv`/`import_kv` use the real blob format (both import torch then).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from pathlib import Path

from syshax.shared.sampling import SamplingParams

from .accelerator_profiles import AcceleratorProfile, ModelScale, load_profile, model_scale
from .engine.config import ModelConfig
from .engine.errors import EngineError, RequestError
from .engine.kv_identity import KVIdentity
from .engine.outputs import EngineStats, StepOutput
from .engine.protocol import PortableKV, SchedulerRequests
from .engine.scheduler import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    ScheduledStep,
    Scheduler,
)

log = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN = 2048
MEANINGLESS_NOTICE = "[emulated accelerator: meaningless text] "
KV_DTYPES = ("float16", "bfloat16", "float32")


def read_model_config(path: Path) -> ModelConfig:
    """The model's config as the real engine reads it (same fingerprint), without loading
    weights: a GGUF's header (and its small rope_freqs tensor) or an HF folder's config.json."""
    if path.is_file() and path.suffix == ".gguf":
        from .engine.gguf_weights import open_gguf

        return ModelConfig.from_hf(open_gguf(path).hf_config, source=str(path), name=path.stem)
    from .engine.hf_weights import read_config

    return ModelConfig.from_hf(read_config(path), source=str(path / "config.json"), name=path.name)


class EmulatedEngine(SchedulerRequests, PortableKV):
    emulated = True  # for whoever labels outputs (the worker, metrics)

    def __init__(
        self,
        model: str | Path | None,
        profile: str | Path | AcceleratorProfile,
        tokenizer=None,
        *,
        max_model_len: int | None = None,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int | None = None,
        scale: float | ModelScale | None = None,
        kv_capacity_tokens: int | None = None,
        kv_dtype: str = "float16",
        block_size: int = DEFAULT_BLOCK_SIZE,
        prefix_caching: bool = True,
        mark_text: bool = True,
        sleep: Callable[[float], None] = time.sleep,
        served_model: str | None = None,
    ):
        """`model`: the farm's model (path, or None for the default), whose shape the KV blobs
        take and whose size scales the profile; `profile`: a built-in name, a YAML/JSON path or
        an `AcceleratorProfile`. `scale` overrides the scale computed from the model (one
        factor, or a `ModelScale`). The running limit is min(max_num_seqs, profile.max_batch);
        the KV cache holds `kv_capacity_tokens` positions (default: the profile's). `kv_dtype`:
        the dtype of exported blobs (a GPU's KV cache: float16). `mark_text`: prefix the first
        text of each request started here with MEANINGLESS_NOTICE. `served_model`: as the
        real engine's (the blobs' identity: this model's weights digest and served name, so
        the CPU workers on the same model take them)."""
        from .engine.loader import resolve_model_path

        if kv_dtype not in KV_DTYPES:
            raise EngineError(f"kv_dtype {kv_dtype!r} is not one of {', '.join(KV_DTYPES)}")
        self.profile = profile if isinstance(profile, AcceleratorProfile) else load_profile(profile)
        self.model_path = resolve_model_path(model)
        self.config = read_model_config(self.model_path)
        self.kv_identity = KVIdentity.of(self.model_path, served_model)
        if scale is None:
            scale = model_scale(self.model_path, self.profile)
        elif not isinstance(scale, ModelScale):
            scale = ModelScale(weights=float(scale), kv=float(scale))
        self.scale: ModelScale = scale
        limit = self.config.max_position_embeddings
        if self.config.sliding_window:
            limit = min(limit, self.config.sliding_window)  # as the real engine caps it
        if max_model_len is None:
            max_model_len = min(limit, DEFAULT_MAX_MODEL_LEN)
        elif max_model_len > limit:
            raise EngineError(
                f"max_model_len {max_model_len} exceeds the model's limit of {limit} positions"
            )
        self.max_model_len = max_model_len
        self.kv_dtype = kv_dtype
        self.tokenizer = tokenizer
        self.mark_text = mark_text
        self._sleep = sleep
        slots = min(max_num_seqs, self.profile.max_batch)
        capacity = kv_capacity_tokens or self.profile.kv_capacity_tokens
        try:
            # No eos stops (as the echo stand-in): a request's own stop_token_ids still apply.
            self.scheduler = Scheduler(
                max_num_seqs=slots,
                max_model_len=max_model_len,
                max_num_batched_tokens=max_num_batched_tokens
                or max(DEFAULT_MAX_NUM_BATCHED_TOKENS, slots),
                num_blocks=capacity // block_size,
                block_size=block_size,
                prefix_caching=prefix_caching,
                vocab_size=self.config.vocab_size,
                tokenizer=tokenizer,
            )
        except ValueError as exc:
            raise EngineError(f"emulated accelerator {self.profile.name!r}: {exc}") from exc
        self.stats = EngineStats()
        log.warning(
            "EMULATED accelerator %r (%s): no model runs here, steps sleep for the profile's "
            "predicted time (scale %.4g weights, %.4g KV vs %s); tokens are the prompt echoed "
            "and the text is MEANINGLESS. KV blobs are zeros in %s's shape, %d slots, "
            "%d KV positions.",
            self.profile.name,
            self.profile.description,
            self.scale.weights,
            self.scale.kv,
            self.profile.reference_model,
            self.config.name,
            slots,
            (capacity // block_size) * block_size,
        )

    @property
    def model_id(self) -> str:
        return self.config.fingerprint()

    # ---- the loop -----------------------------------------------------------------------

    def predicted_seconds(self, step: ScheduledStep) -> float:
        """The profile's time for a scheduled step. Context: the cached positions the step's
        rows attend to (a decode row at position p reads p + 1 with its own; a prompt chunk
        reads the prefix cached before it: its own rows are in prefill_tokens_per_s)."""
        decode_rows = step.decode_rows
        context = sum(c.start for c in step.chunks) + decode_rows
        return self.profile.step_seconds(
            step.num_rows - decode_rows, decode_rows, context, self.scale
        )

    def step(self) -> list[StepOutput]:
        start = time.perf_counter()
        step = self.scheduler.schedule()
        if not step.chunks:
            return []
        decode_rows = step.decode_rows
        seconds = self.predicted_seconds(step)
        tokens = []
        for chunk in step.sampling:
            seq = chunk.seq
            tokens.append(seq.prompt_ids[len(seq.output_ids) % len(seq.prompt_ids)])
        outs = self.scheduler.update(step, tokens, [None] * len(tokens))
        if self.mark_text:
            for out in outs:
                if out.index == 0:
                    out.text = MEANINGLESS_NOTICE + out.text
        # The bookkeeping above overlaps the "GPU" time, as vLLM's async scheduling does: sleep
        # until the predicted end (in a loop: a step never ends early).
        end = start + seconds
        while (left := end - time.perf_counter()) > 0:
            self._sleep(left)
        self.stats.record(step.num_rows - decode_rows, decode_rows, time.perf_counter() - start)
        return outs

    # ---- KV movement --------------------------------------------------------------------

    def export_kv(self, request_id: str, release: bool = True) -> bytes:
        """A blob in the real engine's format and the model's shape, zeros for contents."""
        seq = self.scheduler.sequences.get(request_id)
        if seq is None or not seq.block_table or seq.length - seq.num_cached != 1:
            raise RequestError(f"request {request_id!r} has no KV cache in this engine")
        import torch

        from .engine import kv_format

        c = self.config
        zeros = torch.zeros(
            (c.num_layers, c.num_kv_heads, seq.num_cached, c.head_dim),
            dtype=getattr(torch, self.kv_dtype),
        )
        blob = kv_format.encode(c, zeros, zeros, seq.output_ids[-1], identity=self.kv_identity)
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
        """Continue a request from a blob of this model (ours or a real engine's): the header
        is checked as the real engine checks it; the contents are not needed here."""
        from .engine import kv_format

        header, _ = kv_format.decode_header(blob)
        header.check_compatible(self.config, self.kv_identity)
        header.check_request(prompt_ids, output_ids)
        seq = self.scheduler.new_sequence(request_id, prompt_ids, params, output_ids)
        self.scheduler.add_running(seq, header.num_tokens)
