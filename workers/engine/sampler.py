"""Token sampling for a batch: greedy, temperature, top-k, top-p, per-request seeds, logprobs.

Each sampled token draws its randomness from a generator seeded by (request seed, output
index). So no request depends on another's random state or on the batch it shares, and a
sequence that moves to another worker mid-generation keeps drawing the same tokens.
Random draws happen on the CPU, so a CUDA and a CPU worker agree too.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from syshax.shared.sampling import SamplingParams

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


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], output_index: Sequence[int]
) -> tuple[list[int], list[float | None]]:
    """Pick one token per row of `logits` ([n, V], fp32).

    `output_index[i]` is how many tokens row i has generated before this one.
    Returns the tokens and, where a request asked for them, the chosen token's logprob
    under the model's (unfiltered) distribution.
    """
    tokens = torch.argmax(logits, dim=-1)
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    if sampled_rows:
        cpu_logits = logits[sampled_rows].cpu()
        picks = []
        for row, i in zip(cpu_logits, sampled_rows, strict=True):
            probs = torch.softmax(_filter(row, params[i]), dim=-1)
            gen = token_generator(params[i].seed, output_index[i])
            picks.append(torch.multinomial(probs, 1, generator=gen))
        tokens[sampled_rows] = torch.cat(picks).to(tokens.device)
    logprob_rows = [i for i, p in enumerate(params) if p.logprobs]
    logprobs: list[float | None] = [None] * len(params)
    if logprob_rows:
        lp = torch.log_softmax(logits[logprob_rows], dim=-1)
        chosen = lp.gather(1, tokens[logprob_rows][:, None])[:, 0].tolist()
        for i, v in zip(logprob_rows, chosen, strict=True):
            logprobs[i] = v
    return tokens.tolist(), logprobs
