"""An emulated accelerator: the engine core and the real scheduler, a GPU's step times, no GPU.

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

from .accelerator_profiles import AcceleratorProfile, ModelScale, load_profile, model_scale
from .engine.config import ModelConfig, read_model_config
from .engine.core import EngineCore, ImportedKV, Sampled, StandInRunner, echo_tokens
from .engine.errors import EngineError
from .engine.kv_identity import KVIdentity
from .engine.outputs import StepOutput
from .engine.protocol import PortableKV
from .engine.scheduled_step import ScheduledStep
from .engine.scheduler import DEFAULT_BLOCK_SIZE, Scheduler
from .engine.sequence import Sequence

log = logging.getLogger(__name__)

MEANINGLESS_NOTICE = "[emulated accelerator: meaningless text] "
KV_DTYPES = ("float16", "bfloat16", "float32")


class EmulatedRunner(StandInRunner, PortableKV):
    def __init__(
        self,
        config: ModelConfig,
        kv_identity: KVIdentity,
        profile: AcceleratorProfile,
        scale: ModelScale,
        *,
        kv_dtype: str = "float16",
        mark_text: bool = True,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if kv_dtype not in KV_DTYPES:
            raise EngineError(f"kv_dtype {kv_dtype!r} is not one of {', '.join(KV_DTYPES)}")
        self.config, self.kv_identity, self.profile, self.scale = (
            config,
            kv_identity,
            profile,
            scale,
        )
        self.kv_dtype, self.mark_text, self._sleep = kv_dtype, mark_text, sleep
        self._end = 0.0  # when the step in progress ends, by the profile

    @property
    def model_id(self) -> str:
        return self.config.fingerprint()

    def predicted_seconds(self, step: ScheduledStep) -> float:
        """The profile's time for a scheduled step. Context: the cached positions the step's
        rows attend to (a decode row at position p reads p + 1 with its own; a prompt chunk
        reads the prefix cached before it: its own rows are in prefill_tokens_per_s)."""
        decode_rows = step.decode_rows
        context = sum(c.start for c in step.chunks) + decode_rows
        return self.profile.step_seconds(
            step.num_rows - decode_rows, decode_rows, context, self.scale
        )

    def execute(self, step: ScheduledStep, started: float) -> Sampled:
        self._end = started + self.predicted_seconds(step)
        return echo_tokens(step)

    def finish(self, outputs: list[StepOutput]) -> None:
        if self.mark_text:
            for out in outputs:
                if out.index == 0:
                    out.text = MEANINGLESS_NOTICE + out.text
        # The bookkeeping so far overlaps the "GPU" time, as vLLM's async scheduling does:
        # sleep until the predicted end (in a loop: a step never ends early).
        while (left := self._end - time.perf_counter()) > 0:
            self._sleep(left)

    def export_kv(self, seq: Sequence) -> bytes:
        """A blob in the real engine's format and the model's shape, zeros for contents."""
        import torch

        from .engine import kv_format

        c = self.config
        zeros = torch.zeros(
            (c.num_layers, c.num_kv_heads, seq.num_cached, c.head_dim),
            dtype=getattr(torch, self.kv_dtype),
        )
        return kv_format.encode(c, zeros, zeros, seq.output_ids[-1], identity=self.kv_identity)

    def read_kv(self, blob, prompt_ids: Seq[int], output_ids: Seq[int]) -> ImportedKV:
        """A blob of this model (ours or a real engine's): the header is checked as the real
        engine checks it; the contents are not needed here."""
        from .engine import kv_format

        header, _, _ = kv_format.checked(
            blob, self.config, self.kv_identity, prompt_ids, output_ids, tensors=False
        )
        return ImportedKV(header.num_tokens)


class EmulatedEngine(EngineCore):
    emulated = True  # for whoever labels outputs (the worker, metrics)
    runner: EmulatedRunner

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

        if not isinstance(profile, AcceleratorProfile):
            profile = load_profile(profile)
        self.model_path = resolve_model_path(model)
        config = read_model_config(self.model_path)
        if scale is None:
            scale = model_scale(self.model_path, profile)
        elif not isinstance(scale, ModelScale):
            scale = ModelScale(weights=float(scale), kv=float(scale))
        identity = KVIdentity.of(self.model_path, served_model)
        runner = EmulatedRunner(
            config, identity, profile, scale, kv_dtype=kv_dtype, mark_text=mark_text, sleep=sleep
        )
        slots = min(max_num_seqs, profile.max_batch)
        capacity = kv_capacity_tokens or profile.kv_capacity_tokens
        try:
            # No eos stops (as the echo stand-in): a request's own stop_token_ids still apply.
            scheduler = Scheduler(
                max_num_seqs=slots,
                max_model_len=config.context_length(max_model_len),  # as the real engine's
                max_num_batched_tokens=max_num_batched_tokens,
                num_blocks=capacity // block_size,
                block_size=block_size,
                prefix_caching=prefix_caching,
                vocab_size=config.vocab_size,
                tokenizer=tokenizer,
            )
        except ValueError as exc:
            raise EngineError(f"emulated accelerator {profile.name!r}: {exc}") from exc
        super().__init__(runner, scheduler, tokenizer)
        self.config, self.profile, self.scale = config, profile, scale
        self._announce()

    def _announce(self) -> None:
        blocks = self.scheduler.blocks
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
            self.num_slots,
            blocks.num_blocks * blocks.block_size,
        )
