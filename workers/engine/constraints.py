"""Structured outputs, the sampler's half (issue 28): one llguidance matcher per constrained
sequence, the allowed-token mask it gives before each token, and the token it then consumes.

A matcher is rebuilt from the spec and the tokens generated so far (`Constraint.start`), so a
sequence resumed on another worker (a KV handoff, a crash) continues under the same grammar.
Once the grammar is complete only the end of sequence is allowed, so a constrained answer
always ends where its grammar does (or at max_tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from syshax.shared import structured


class Constraint:
    def __init__(self, matcher: Any, vocab: int, eos: int) -> None:
        self.matcher, self.vocab, self.eos = matcher, vocab, eos

    @classmethod
    def start(cls, spec: dict[str, Any], ll_tok: Any, vocab: int, output_ids: Sequence[int]):
        """A matcher for `spec` that has consumed `output_ids` (a resumed sequence's tokens)."""
        import llguidance

        matcher = llguidance.LLMatcher(ll_tok, structured.check(spec, ll_tok))
        if output_ids and not matcher.consume_tokens(list(output_ids)):
            raise structured.StructuredError(
                f"the tokens so far do not follow the grammar: {matcher.get_error()}"
            )
        return cls(matcher, vocab, ll_tok.eos_token)

    def allowed(self) -> torch.Tensor:
        """A bool mask over the model's vocabulary: the tokens the grammar allows next."""
        if self.matcher.is_stopped():  # complete: only the end of the sequence
            mask = torch.zeros(self.vocab, dtype=torch.bool)
            mask[self.eos] = True
            return mask
        raw = torch.frombuffer(bytearray(self.matcher.compute_logit_bias()), dtype=torch.uint8)
        mask = torch.zeros(self.vocab, dtype=torch.bool)
        n = min(self.vocab, raw.numel())
        mask[:n] = raw[:n].bool()
        return mask

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` (a speculative draft) the grammar accepts in a row from its
        state now, without consuming them."""
        if self.matcher.is_stopped():
            return 0
        return int(self.matcher.validate_tokens(list(tokens)))

    def advance(self, token: int) -> None:
        """Consume the sampled token (an EOS after completion is accepted as the end)."""
        if self.matcher.is_stopped():
            return
        if not self.matcher.consume_token(int(token)):
            raise structured.StructuredError(
                f"token {token} broke the grammar: {self.matcher.get_error()}"
            )


def apply_masks(logits: torch.Tensor, rows: Sequence[int], masks: Sequence[torch.Tensor]) -> None:
    """Forbid (-inf) every token a row's mask does not allow, in place."""
    for row, mask in zip(rows, masks, strict=True):
        logits[row].masked_fill_(~mask.to(logits.device), float("-inf"))
