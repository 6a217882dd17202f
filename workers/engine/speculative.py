"""Speculative decoding, the scheduler's half (torch-free): what to propose, how many tokens,
and when not to speculate at all.

At batch 1-4 a CPU decode step is bound by streaming the weights, not by arithmetic: the fused
step computes rows in 16-row tiles, so k+1 rows of one sequence cost about what one row does.
A sequence that proposes k tokens gets them checked in one step: the target model computes
the logits of all k+1 positions, the verifier (spec_verify.py) keeps the longest prefix the
target agrees with and adds the target's own next token, so a step yields 1 to k+1 tokens.

* Proposer: n-gram prompt lookup (vLLM's ngram proposer, llama.cpp's ngram modes): the last n
  tokens (max_n down to min_n) are looked up in the sequence's prompt and output, the latest
  earlier occurrence wins, and the k tokens that followed it are proposed. No extra model: it
  pays on input-grounded work (repeat, rewrite, fix, extract, edit code).
* k adapts per sequence: an exponential average of the share of proposed tokens accepted
  sets the next k (between 1 and `num_tokens`), so a sequence whose text is not in its
  context stops paying for rows it throws away.
* Off when compute-bound: the step's decode rows (one per stream plus the drafts) stay within
  `max_step_rows` (default 16, one GEMM tile). Draft rows share what is left after every
  stream's own row, so with 16 or more streams decoding nobody speculates.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence as Seq
from dataclasses import dataclass

METHODS = ("none", "ngram", "draft")
DEFAULT_NUM_TOKENS = 5
DEFAULT_MAX_STEP_ROWS = 16  # one tile of the fused step's GEMM
EMA_WEIGHT = 0.3  # weight of the newest step in a sequence's acceptance average


@dataclass(frozen=True)
class SpecConfig:
    """`method`: "none" | "ngram" ("draft" is refused by `check`: not built yet).
    `num_tokens`: the most tokens a sequence proposes per step. `ngram_min`/`ngram_max`: the
    n-gram lengths looked up. `max_step_rows`: speculation only while a step's decode rows,
    drafts included, stay within this many."""

    method: str = "none"
    num_tokens: int = DEFAULT_NUM_TOKENS
    ngram_min: int = 2
    ngram_max: int = 4
    max_step_rows: int = DEFAULT_MAX_STEP_ROWS
    draft_model: str | None = None

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    def check(self) -> SpecConfig:
        """Raise ValueError for settings that cannot run; returns self."""
        if self.method not in METHODS:
            raise ValueError(f"speculative.method {self.method!r} is not one of {', '.join(METHODS)}")  # fmt: skip
        if self.method == "draft":
            raise ValueError(
                "speculative.method 'draft' (a draft model) is not built yet; use 'ngram'"
            )
        if self.num_tokens < 1:
            raise ValueError(f"speculative.num_tokens must be >= 1, got {self.num_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(
                f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min} and {self.ngram_max}"
            )
        if self.max_step_rows < 2:
            raise ValueError(f"speculative.max_step_rows must be >= 2, got {self.max_step_rows}")
        return self


def ngram_propose(ids: Seq[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the last n tokens of
    `ids` (n from max_n down to min_n; the longest match wins). [] when nothing matches."""
    if k < 1 or len(ids) < min_n + 1:
        return []
    haystack = array("I", ids).tobytes()  # token ids as 4-byte words: bytes.rfind is C-fast
    width = array("I").itemsize
    for n in range(min(max_n, len(ids) - 1), min_n - 1, -1):
        needle = haystack[-n * width :]
        limit = len(haystack) - width  # the match must end before the last token
        while (at := haystack.rfind(needle, 0, limit)) >= 0:
            if at % width == 0:  # aligned to a token, not straddling two
                follow = at // width + n
                return list(ids[follow : follow + k])
            limit = at + len(needle) - 1  # look again, starting before `at`
    return []


class SpecPolicy:
    """Per-sequence k and the step's draft-row share, from a `SpecConfig`."""

    def __init__(self, config: SpecConfig) -> None:
        self.config = config.check()

    def draft_rows_each(self, num_decodes: int) -> int:
        """Draft rows each of `num_decodes` decoding streams may add this step (0: off)."""
        if num_decodes < 1:
            return 0
        return max(0, (self.config.max_step_rows - num_decodes) // num_decodes)

    def propose(self, ids: Seq[int], k: int) -> list[int]:
        c = self.config
        return ngram_propose(ids, k, c.ngram_min, c.ngram_max)

    def wanted(self, acceptance: float | None) -> int:
        """The k a sequence asks for: num_tokens until it has a record, then its acceptance
        average times num_tokens, rounded up (at least 1)."""
        top = self.config.num_tokens
        if acceptance is None:
            return top
        return max(1, min(top, math.ceil(acceptance * top)))

    @staticmethod
    def updated(acceptance: float | None, proposed: int, accepted: int) -> float:
        share = accepted / proposed
        if acceptance is None:
            return share
        return (1 - EMA_WEIGHT) * acceptance + EMA_WEIGHT * share
