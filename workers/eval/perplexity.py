"""Perplexity of a model on a text, in the manner of llama.cpp's llama-perplexity, and the KL
divergence of its predictions from a base run's.

The token ids are cut into chunks of n_ctx (the tail that fills no chunk is left out); each
chunk is computed as a fresh sequence from position 0, and only its second half is scored,
as llama.cpp does: the first n_ctx/2 positions are context, so every scored prediction sees
at least n_ctx/2 tokens. Position i's output predicts token i + 1, so a chunk scores
n_ctx - 1 - n_ctx/2 tokens. `--save-logits` keeps the scored rows' log-probabilities
(logit_file.py); a later run with `--kl-base` compares its rows against them (stats.py).

The model is any `LogitsFn`: the command gives the engine's `prompt_logits` (all-position
logits of a prefill, on the CPU default: native blocks, fused step); the tests give toys.
Torch-free.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from .logit_file import LogitReader, LogitWriter, RunShape
from .stats import KLDivergence, KLSummary, Perplexity, compare_rows, log_softmax, target_nll

# (a chunk's token ids, first row wanted) -> logits [len(ids) - first, vocab] of those rows
LogitsFn = Callable[[list[int], int], np.ndarray]


class EvalError(ValueError):
    """The text and context length cannot be scored as asked; the message says why."""


@dataclass
class PerplexityResult:
    n_ctx: int
    n_chunks: int
    n_tokens: int  # of the whole text
    count: int  # scored tokens
    ppl: float
    ppl_err: float
    chunk_ppl: list[float] = field(default_factory=list)  # running PPL after each chunk
    kl: KLSummary | None = None
    seconds: float = 0.0


def first_scored(n_ctx: int) -> int:
    """The first scored row of a chunk: its first half is context only."""
    return n_ctx // 2


def plan_chunks(n_tokens: int, n_ctx: int) -> int:
    """How many whole chunks of n_ctx the text gives; EvalError when none."""
    if n_ctx < 4:
        raise EvalError(f"context length {n_ctx} is too short to score (at least 4)")
    n_chunks = n_tokens // n_ctx
    if n_chunks < 1:
        raise EvalError(
            f"the text has {n_tokens} tokens, fewer than one chunk of {n_ctx}: "
            "use a longer text or a smaller --ctx"
        )
    return n_chunks


def evaluate(
    logits_fn: LogitsFn,
    tokens: Sequence[int],
    n_ctx: int,
    vocab: int,
    *,
    save: str | Path | None = None,
    base: str | Path | None = None,
    model_name: str = "",
    progress: bool = True,
) -> PerplexityResult:
    """Score `tokens` chunk by chunk; with `save`, write the scored rows' log-probabilities;
    with `base`, compare against a saved run of the same tokens and n_ctx."""
    tokens = list(tokens)
    n_chunks = plan_chunks(len(tokens), n_ctx)
    first = first_scored(n_ctx)
    shape = RunShape.of(tokens, n_ctx, vocab, n_chunks, n_ctx - 1 - first)
    reader = LogitReader(base) if base is not None else None
    if reader is not None:
        reader.check(shape)
    writer = LogitWriter(save, shape, model_name) if save is not None else None
    ppl, kl = Perplexity(), KLDivergence()
    result = PerplexityResult(n_ctx, n_chunks, len(tokens), 0, 0.0, 0.0)
    started = time.perf_counter()
    bar = tqdm(total=n_chunks, unit="chunk", desc="perplexity", disable=not progress)
    try:
        for i in range(n_chunks):
            ids = tokens[i * n_ctx : (i + 1) * n_ctx]
            logits = np.asarray(logits_fn(ids, first))
            if logits.shape != (n_ctx - first, vocab):
                raise EvalError(
                    f"the model gave logits {logits.shape}, not {(n_ctx - first, vocab)}"
                )
            lp = log_softmax(logits[:-1])  # the last row predicts past the chunk
            targets = np.asarray(ids[first + 1 :])
            ppl.add(target_nll(lp, targets))
            if writer is not None:
                writer.write_chunk(lp)
            if reader is not None:
                kl.add(compare_rows(reader.chunk(i), lp, targets))
            result.chunk_ppl.append(ppl.value()[0])
            bar.set_postfix(ppl=f"{result.chunk_ppl[-1]:.4f}")
            bar.update(1)
    except BaseException:
        if writer is not None:
            writer.abandon()
        raise
    finally:
        bar.close()
    if writer is not None:
        writer.close()
    result.count = ppl.count
    result.ppl, result.ppl_err = ppl.value()
    result.kl = kl.summary() if reader is not None else None
    result.seconds = time.perf_counter() - started
    return result
