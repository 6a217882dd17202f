"""The model engine: one model on one device, running many sequences with continuous batching.

`Engine(model, **options)` is the engine core (core.py: the torch-free scheduler, the step
loop, the request and KV API) with a `ModelRunner` (model_runner.py: the loaded model, its
paged KV cache and a forward, one native call per step on the CPU). A sequence's KV cache can
be exported to a portable blob and imported into another engine (another process, device or
dtype) to continue decoding there.
"""

from __future__ import annotations

import gc
import logging
from pathlib import Path

from syshax.shared.sampling import SamplingParams

from .core import EngineCore
from .errors import RequestError
from .model_runner import ModelOptions, ModelRunner, resolve_device
from .outputs import EngineStats, StepOutput
from .scheduler import Scheduler
from .sequence import Sequence

__all__ = [
    "Engine",
    "EngineStats",
    "ModelOptions",
    "StepOutput",
    "freeze_loaded_heap",
    "resolve_device",
]

log = logging.getLogger(__name__)


def freeze_loaded_heap() -> None:
    """Move every object alive now (modules, weights' Python wrappers, the tokenizer) out of
    the garbage collector's generations, so the collections the decode loop triggers do not
    walk them: that was 2-4% of a CPU decode step at batch 1. For a process's entry point,
    once its engine is loaded (as vLLM does); never from library code, because cyclic
    garbage frozen with it is never freed."""
    gc.collect()
    gc.freeze()


class Engine(EngineCore):
    runner: ModelRunner

    def __init__(
        self, model: str | Path | None = None, options: ModelOptions | None = None, **kwargs
    ) -> None:
        """`model`: an HF folder, a GGUF file, or None for the default (SmolLM2). The options
        are `ModelOptions`' fields, given as keywords or as one `options`."""
        opts = options or ModelOptions(**kwargs)
        runner = ModelRunner.load(model, opts)
        tokenizer = None
        if opts.load_tokenizer:
            from syshax.shared.tokenizer import Tokenizer

            tokenizer = Tokenizer.from_model_path(runner.model_path)
        eos = set(runner.config.eos_token_ids)
        if tokenizer is not None:
            eos.update(tokenizer.eos_token_ids)
        self.eos_token_ids = frozenset(eos)
        scheduler = Scheduler(
            max_num_seqs=opts.max_num_seqs,
            max_model_len=runner.max_model_len,
            max_num_batched_tokens=opts.max_num_batched_tokens,
            num_blocks=runner.cache.num_blocks,
            block_size=opts.block_size,
            prefix_caching=opts.prefix_caching,
            vocab_size=runner.config.vocab_size,
            stop_token_ids=self.eos_token_ids,
            tokenizer=tokenizer,
            prompt_rows_while_decoding=opts.prompt_rows_while_decoding,
            prompt_stretch=opts.prompt_stretch,
            speculation=opts.speculative,
        )
        spec = opts.speculative
        if scheduler.spec is not None:  # a worker's log says what its steps do
            c = scheduler.spec.config
            log.info("speculative decoding: %s, up to %d tokens a step while a step's decode rows stay within %d", c.method, c.num_tokens, c.max_step_rows)  # fmt: skip
        if spec is not None and spec.method == "draft":  # the draft model, on the same device
            from .draft_proposer import load_drafter

            scheduler.drafter = load_drafter(opts, runner, tokenizer, scheduler.spec)
        super().__init__(runner, scheduler, tokenizer)
        if tokenizer is not None:  # built on the first constrained request (about a second)
            from syshax.shared import structured

            vocab = runner.config.vocab_size
            runner.ll_tokenizer = lambda: structured.ll_tokenizer(tokenizer, vocab)
        # The loaded model's parts, for the tools and tests that look inside.
        self.config, self.model, self.model_path = runner.config, runner.model, runner.model_path
        self.device, self.cache, self.fused = runner.device, runner.cache, runner.fused

    def prompt_logits(self, token_ids: list[int], first: int = 0):
        """The logits [len(token_ids) - first, vocab] (fp32 torch tensor) of every position from
        `first` on, for `token_ids` computed as a fresh sequence from position 0 (row i predicts
        token i + 1): what perplexity and KL divergence score. Only while the engine runs no
        request; the sequence's KV blocks are freed after (never prefix-cached)."""
        n = len(token_ids)
        if not 0 <= first < n:
            raise RequestError(f"first scored row {first} is outside the {n} tokens")
        if n > self.max_model_len:
            raise RequestError(f"{n} tokens is more than max_model_len {self.max_model_len}")
        vocab = self.config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary (size {vocab})")
        if self.scheduler.has_unfinished():
            raise RequestError("prompt_logits runs only while the engine has no requests")
        seq = Sequence("prompt-logits", list(token_ids), SamplingParams(max_tokens=1))
        if not self.scheduler.blocks.grow(seq, n):
            raise RequestError(f"no room in the KV cache for {n} positions")
        try:
            return self.runner.prompt_logits(seq.prompt_ids, seq.block_table, first)
        finally:
            self.scheduler.blocks.release(seq)
