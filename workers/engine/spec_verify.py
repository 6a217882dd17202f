"""Speculative decoding, the target's half: a chunk's draft checked against the logits of its
k+1 rows (row j: the distribution of the token after the last token and drafts[:j]).

Position by position, each row gets the same processing a plain decode's row gets (logit_bias
and penalties counting the tokens accepted before it, the grammar mask after them), then:

* greedy: the row's argmax; a draft token is accepted while it equals it, and the first
  argmax that differs is the target's own token. The text is the one plain greedy decoding
  gives (up to float rounding between a step of one row and one of k+1).
* sampling: speculative sampling (Leviathan et al. 2023; Chen et al. 2023): accept d with
  probability min(1, p(d) / q(d)), else draw from the residual max(0, p - q) normalised.
  q is a draft model's distribution (its row for that position, draft_proposer.py) or a
  point mass (n-gram drafts have q(d) = 1: accept with p(d), else draw from p without d).
  Every emitted token is distributed as p, as in plain sampling. The draws use the request's
  per-token generators (sampler.token_generator), so a seeded request repeats itself, but
  not the same tokens as without speculation (the draws differ).

After all k drafts are accepted the last row gives one more token: a step yields 1 to k+1.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import logits as processing
from .core import Sampled
from .sampler import _constraint, _filter, sample_sequences, token_generator


def sample_step(
    logits: torch.Tensor, chunks: Sequence[Any], ll_tokenizer: Callable[[], Any] | None = None
) -> Sampled:
    """The tokens of a step's sampling chunks, some with drafts: `logits` holds one row per
    plain chunk and 1 + len(draft) rows per chunk with a draft, in chunk order. Plain chunks
    are sampled together (sample_sequences); the result lists each chunk's tokens in order,
    with `counts`."""
    plain, at, spans = [], 0, []
    for i, c in enumerate(chunks):
        rows = 1 + len(c.draft)
        spans.append((at, rows))
        if not c.draft:
            plain.append(i)
        at += rows
    runs: dict[int, Sampled] = {}
    if plain:
        rows_of = [spans[i][0] for i in plain]
        batch = sample_sequences(logits[rows_of], [chunks[i].seq for i in plain], ll_tokenizer)
        for k, i in enumerate(plain):
            assert batch.tops is not None
            runs[i] = Sampled([batch.tokens[k]], [batch.logprobs[k]], [batch.tops[k]])
    out = Sampled([], [], [], [])
    for i, c in enumerate(chunks):
        start, rows = spans[i]
        run = runs.get(i) or verify(
            logits[start : start + rows], c.seq, c.draft, ll_tokenizer, getattr(c, "draft_q", None)
        )
        out.tokens += run.tokens
        out.logprobs += run.logprobs
        out.tops += run.tops or [None] * len(run.tokens)  # type: ignore[operator]
        out.counts.append(len(run.tokens))  # type: ignore[union-attr]
    return out


def verify(
    rows: torch.Tensor,
    seq: Any,
    draft: Sequence[int],
    ll_tokenizer: Callable[[], Any] | None = None,
    q: torch.Tensor | None = None,
) -> Sampled:
    """The tokens one sequence's step yields: its accepted drafts, then the target's token.
    `rows`: [len(draft) + 1, V] fp32 logits; `q`: [len(draft), V], the distributions the
    drafts were drawn from (None: point masses)."""
    p = seq.params
    want_lp = bool(p.logprobs or p.top_logprobs)
    simple = p.greedy and not processing.needs_processing(p) and p.structured is None
    if simple and not want_lp:
        best = rows.argmax(dim=-1).tolist()
        n = _agreeing(best, draft)
        return Sampled(best[: n + 1], [None] * (n + 1), [None] * (n + 1))
    constraint = _constraint(seq, rows.shape[-1], ll_tokenizer) if p.structured else None
    tokens: list[int] = []
    for j in range(len(draft) + 1):
        work = rows[j]
        if processing.needs_processing(p):
            work = processing.process_row(work, p, seq.prompt_ids, seq.output_ids + tokens)
        if constraint is not None:
            work = work.masked_fill(~constraint.allowed(), float("-inf"))
        proposed = draft[j] if j < len(draft) else None
        q_row = q[j] if q is not None and proposed is not None else None
        token = _pick(work, p, proposed, len(seq.output_ids) + len(tokens), q_row)
        if constraint is not None:
            constraint.advance(token)
        tokens.append(token)
        if token != proposed:
            break
    out = Sampled(tokens, [None] * len(tokens), [None] * len(tokens))
    if want_lp:
        lp = torch.log_softmax(rows[: len(tokens)], dim=-1)
        for j, token in enumerate(tokens):
            if p.logprobs:
                out.logprobs[j] = float(lp[j, token])
            if p.top_logprobs:
                ids, values = processing.top_logprobs(lp[j], p.top_logprobs)
                out.tops[j] = list(zip(ids, values, strict=True))  # type: ignore[index]
    return out


def _agreeing(best: Sequence[int], draft: Sequence[int]) -> int:
    """How many leading drafts equal the target's argmax."""
    n = 0
    while n < len(draft) and best[n] == draft[n]:
        n += 1
    return n


def _pick(
    work: torch.Tensor, p: Any, proposed: int | None, index: int, q: torch.Tensor | None = None
) -> int:
    """One position's token: greedy argmax, or the speculative-sampling rule for `proposed`
    (None: a plain draw) drawn from `q` (None: a point mass), with output token `index`'s
    generator."""
    if p.greedy:
        return int(torch.argmax(work))
    probs = torch.softmax(_filter(work.cpu(), p), dim=-1)
    probs = processing.apply_min_p(probs, p.min_p)
    probs = probs / probs.sum()
    gen = token_generator(p.seed, index)
    if proposed is not None:
        q_d = 1.0 if q is None else float(q[proposed])
        share = min(1.0, float(probs[proposed]) / q_d) if q_d > 0 else 1.0
        if float(torch.rand((), generator=gen)) < share:
            return proposed
        if q is None:
            residual = probs.clone()
            residual[proposed] = 0.0  # max(0, p - q) for a point mass q at `proposed`
        else:
            residual = (probs - q.to(probs)).clamp_(min=0.0)
        if float(residual.sum()) > 0:  # 0 only where p == q, when rejection never happens
            probs = residual
    return int(torch.multinomial(probs, 1, generator=gen))
