"""What one engine step is: the `Chunk`s of token rows it computes (`ScheduledStep`), made by
the scheduler (scheduler.py) and turned into logits by a runner, and `step_budget`, the check of
the limits on a step's rows (the token budget, the running sequences, the prompt rows a step
with decodes takes) that engines run before they load anything. Torch-free, like the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .sequence import Sequence

DEFAULT_MAX_NUM_BATCHED_TOKENS = 256


def step_budget(
    max_num_seqs: int,
    max_num_batched_tokens: int | None = None,
    prompt_rows_while_decoding: int | None = None,
) -> int:
    """The token rows a step computes at most (None: DEFAULT_MAX_NUM_BATCHED_TOKENS, raised to
    the running limit), checked with the limits it must fit; raises ValueError. The one check
    of these limits: engines call it before loading anything, so a bad value fails at once."""
    if prompt_rows_while_decoding is not None and prompt_rows_while_decoding < 1:
        raise ValueError(
            f"prompt_rows_while_decoding must be >= 1, got {prompt_rows_while_decoding}"
        )
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    budget = max_num_batched_tokens or max(DEFAULT_MAX_NUM_BATCHED_TOKENS, max_num_seqs)
    if budget < max_num_seqs:
        raise ValueError(
            f"max_num_batched_tokens ({budget}) must be at least max_num_seqs "
            f"({max_num_seqs}): every running sequence decodes one row per step"
        )
    return budget


@dataclass
class Chunk:
    """Rows `[start, start + length)` of one sequence, computed in one step."""

    seq: Sequence
    start: int
    length: int
    draft: list[int] = field(default_factory=list)  # proposed tokens, the chunk's last rows
    draft_q: Any = None  # a draft model's q rows for sampled drafts (None: point masses)

    @property
    def samples(self) -> bool:
        """Does this chunk reach the sequence's end (its last row's logits give a token; with
        a draft, every row's logits do)?"""
        return self.start + self.length - len(self.draft) == self.seq.length

    @property
    def token_ids(self) -> list[int]:
        ids = self.seq.all_ids + self.draft
        return ids[self.start : self.start + self.length]


@dataclass
class ScheduledStep:
    chunks: list[Chunk] = field(default_factory=list)  # decodes first, then prompt chunks

    @property
    def num_rows(self) -> int:
        return sum(c.length for c in self.chunks)

    @property
    def sampling(self) -> list[Chunk]:
        return [c for c in self.chunks if c.samples]

    @property
    def decode_rows(self) -> int:
        """Rows that extend a sequence already generating (the rest are prompt rows)."""
        return sum(c.length for c in self.chunks if c.start >= c.seq.prefill_end)
