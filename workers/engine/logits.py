"""What a request may do to its logits before a token is picked (issue 28), in vLLM's order and
with vLLM's semantics, so its clients get the same behaviour:

1. `logit_bias`: token id -> a value added to its logit (OpenAI: -100..100; -100 bans it);
2. `repetition_penalty` (vLLM's, > 0; 1 = off): every token seen in the prompt or the output has
   a positive logit divided by it and a negative one multiplied by it;
3. `frequency_penalty` and `presence_penalty` (OpenAI's, -2..2): minus the penalty times the
   token's count in the output so far, and minus the penalty once if it appeared at all;
4. then the sampler's temperature, `min_p` (drop tokens whose probability is below min_p times
   the most likely one's), top-k and top-p.

Greedy requests take the argmax of the processed logits, so a bias or a penalty changes a greedy
answer too. Logprobs (the chosen token's, and `top_logprobs`) are the model's own, before any
of this, as vLLM returns them by default: under plain greedy decoding the chosen token is the
first of the top logprobs.

Everything here works on fp32 rows on the logits' device; the counts are built per row from the
token ids the sequence holds (a sequence moved to another worker carries its tokens, so a
penalty continues exactly after a KV handoff).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from syshax.shared.sampling import SamplingParams


def needs_processing(p: SamplingParams) -> bool:
    return bool(
        p.logit_bias
        or p.repetition_penalty != 1.0
        or p.frequency_penalty != 0.0
        or p.presence_penalty != 0.0
    )


def process_row(
    row: torch.Tensor, p: SamplingParams, prompt_ids: Sequence[int], output_ids: Sequence[int]
) -> torch.Tensor:
    """One row of fp32 logits after logit_bias and the penalties (a new tensor)."""
    row = row.clone()
    vocab = row.shape[-1]
    if p.logit_bias:
        ids = torch.tensor([int(t) for t in p.logit_bias], dtype=torch.long, device=row.device)
        bias = torch.tensor(list(p.logit_bias.values()), dtype=row.dtype, device=row.device)
        keep = ids < vocab  # the gateway checks ids against the tokenizer; the head may be smaller
        row.index_add_(0, ids[keep], bias[keep])
    if p.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool, device=row.device)
        for ids in (prompt_ids, output_ids):
            if len(ids):
                seen[torch.as_tensor(list(ids), dtype=torch.long, device=row.device)] = True
        scaled = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
        row = torch.where(seen, scaled, row)
    if (p.frequency_penalty or p.presence_penalty) and len(output_ids):
        out = torch.as_tensor(list(output_ids), dtype=torch.long, device=row.device)
        counts = torch.bincount(out, minlength=vocab)[:vocab].to(row.dtype)
        row = row - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(row.dtype)
    return row


def apply_min_p(probs: torch.Tensor, min_p: float) -> torch.Tensor:
    """Zero the probabilities below min_p times the largest (one row; not renormalised:
    multinomial takes weights)."""
    if min_p <= 0.0:
        return probs
    return probs.masked_fill(probs < min_p * probs.max(), 0.0)


def top_logprobs(logprobs: torch.Tensor, k: int) -> tuple[list[int], list[float]]:
    """The k most likely tokens of one row of log-probabilities, most likely first."""
    if k <= 0:
        return [], []
    values, ids = torch.topk(logprobs, min(k, logprobs.shape[-1]), sorted=True)
    return ids.tolist(), values.tolist()
