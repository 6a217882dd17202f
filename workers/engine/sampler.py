"""Token sampling for a batch: greedy, temperature, top-k, top-p, min_p, per-request seeds,
logprobs and top logprobs, after each request's logits processing (logit_bias, penalties:
logits.py) and structured-output mask (constraints.py).

Each sampled token draws its randomness from a generator seeded by (request seed, output
index). So no request depends on another's random state or on the batch it shares, and a
sequence that moves to another worker mid-generation keeps drawing the same tokens.
Random draws happen on the CPU, so a CUDA and a CPU worker agree too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from syshax.shared.sampling import SamplingParams

from . import logits as processing
from .constraints import Constraint, apply_masks
from .core import Sampled

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads consecutive indices over the seed space


def token_generator(seed: int, index: int) -> torch.Generator:
    """The generator for output token `index` of a request seeded with `seed`."""
    return torch.Generator().manual_seed((seed ^ (_MIX * (index + 1))) % (2**63))


def _filter(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus) on one row of fp32 logits."""
    logits = logits / p.temperature
    if 0 < p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        # Drop a token when the tokens before it already reach top_p (the first always stays).
        drop = (cum - torch.softmax(sorted_logits, dim=-1)) >= p.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(0, order, sorted_logits)
    return logits


def sample_sequences(
    logits: torch.Tensor, seqs: Sequence[Any], ll_tokenizer: Callable[[], Any] | None = None
) -> Sampled:
    """One token per row of `logits` ([n, V], fp32) for the sequences `seqs` (each with
    prompt_ids, output_ids, params and a `constraint` slot), in vLLM's order: the model's
    logprobs first (returned as they are), then logit_bias and penalties, the structured-output
    mask, and greedy or seeded sampling (temperature, min_p, top-k, top-p). A constrained
    sequence's matcher is built on first use (from the tokens so far: a resumed or handed-off
    sequence continues under its grammar) and advanced with the chosen token."""
    params = [s.params for s in seqs]
    want_lp = [i for i, p in enumerate(params) if p.logprobs or p.top_logprobs]
    lp_rows = torch.log_softmax(logits[want_lp], dim=-1) if want_lp else None
    work = logits
    processed = [i for i, p in enumerate(params) if processing.needs_processing(p)]
    constrained = [i for i, p in enumerate(params) if p.structured is not None]
    if processed or constrained:
        work = logits.clone()
    for i in processed:
        work[i] = processing.process_row(work[i], params[i], seqs[i].prompt_ids, seqs[i].output_ids)  # fmt: skip
    constraints = [_constraint(seqs[i], logits.shape[-1], ll_tokenizer) for i in constrained]
    if constrained:
        apply_masks(work, constrained, [c.allowed() for c in constraints])
    tokens = torch.argmax(work, dim=-1)
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    if sampled_rows:
        picks = []
        for row, i in zip(work[sampled_rows].cpu(), sampled_rows, strict=True):
            probs = processing.apply_min_p(torch.softmax(_filter(row, params[i]), dim=-1), params[i].min_p)  # fmt: skip
            picks.append(torch.multinomial(probs, 1, generator=token_generator(params[i].seed, len(seqs[i].output_ids))))  # fmt: skip
        tokens[sampled_rows] = torch.cat(picks).to(tokens.device)
    chosen = tokens.tolist()
    for i, c in zip(constrained, constraints, strict=True):
        c.advance(chosen[i])
    out = Sampled(chosen, [None] * len(seqs), [None] * len(seqs))
    for k, i in enumerate(want_lp):
        assert lp_rows is not None
        if params[i].logprobs:
            out.logprobs[i] = float(lp_rows[k, chosen[i]])
        if params[i].top_logprobs:
            ids, values = processing.top_logprobs(lp_rows[k], params[i].top_logprobs)
            out.tops[i] = list(zip(ids, values, strict=True))
    return out


def _constraint(seq: Any, vocab: int, ll_tokenizer: Callable[[], Any] | None) -> Constraint:
    if seq.constraint is None:
        if ll_tokenizer is None:
            raise ValueError("structured outputs need the engine's tokenizer")
        seq.constraint = Constraint.start(seq.params.structured, ll_tokenizer(), vocab, seq.output_ids)  # fmt: skip
    return seq.constraint
