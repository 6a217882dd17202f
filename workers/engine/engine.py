"""The model engine: one model on one device, running many sequences with continuous batching.

`Engine(model, **options)` is the engine core (core.py: the torch-free scheduler, the step
loop, the request and KV API) with a `ModelRunner` (model_runner.py: the loaded model, its
paged KV cache and a forward, one native call per step on the CPU). A sequence's KV cache can
be exported to a portable blob and imported into another engine (another process, device or
dtype) to continue decoding there.
"""

from __future__ import annotations

import gc
from pathlib import Path

from .core import EngineCore
from .model_runner import ModelOptions, ModelRunner, resolve_device
from .outputs import EngineStats, StepOutput
from .scheduler import Scheduler

__all__ = [
    "Engine",
    "EngineStats",
    "ModelOptions",
    "StepOutput",
    "freeze_loaded_heap",
    "resolve_device",
]


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
        )
        super().__init__(runner, scheduler, tokenizer)
        if tokenizer is not None:  # built on the first constrained request (about a second)
            from syshax.shared import structured

            vocab = runner.config.vocab_size
            runner.ll_tokenizer = lambda: structured.ll_tokenizer(tokenizer, vocab)
        # The loaded model's parts, for the tools and tests that look inside.
        self.config, self.model, self.model_path = runner.config, runner.model, runner.model_path
        self.device, self.cache, self.fused = runner.device, runner.cache, runner.fused
