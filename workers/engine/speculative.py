"""Speculative decoding, the scheduler's half (torch-free): what to propose, how many tokens,
and when not to speculate at all.

At batch 1-4 a CPU decode step is bound by streaming the weights, not by arithmetic: the fused
step computes rows in 16-row tiles, so k+1 rows of one sequence cost about what one row does.
A sequence that proposes k tokens gets them checked in one step: the target model computes
the logits of all k+1 positions, the verifier (spec_verify.py) keeps the longest prefix the
target agrees with and adds the target's own next token, so a step yields 1 to k+1 tokens.

* Proposer: n-gram prompt lookup (vLLM's ngram proposer, llama.cpp's ngram modes): the longest
  suffix of the sequence's ids (2 to 32 tokens) that occurred before in its prompt or output
  is found (ngram_lookup.py), and the tokens that followed it are proposed (the latest
  occurrence, unless most occurrences continue otherwise). When no suffix recurs because
  the sequence just changed a token of what it copies, the copy is picked up where it was
  (`ngram_lookup.realign`). No extra model: it pays on
  input-grounded work (repeat, rewrite, fix, extract, edit code). Or a draft model
  with the target's tokenizer (draft_proposer.py; the scheduler's `drafter`), whose k small
  steps are priced into k too.
* k adapts per sequence and to the machine: each sequence keeps an average of its per-token
  acceptance a (of the drafts checked, the share accepted), the engine reports what decode
  steps of each row count cost, and k (0 to `num_tokens`) is the one with the most expected
  tokens (1 + a + ... + a^k) per second of step. An n-gram draft is priced after its match
  is found: a is the average of the sequence's own and its match class's (the matched length
  and whether the earlier occurrences agree, learned over every sequence's drafts), so a long
  unanimous match proposes many tokens and a 1-2 token one in a paraphrase few or none.
  Where extra rows are nearly free (a few rows on a bandwidth-bound step) k stays high;
  where each row costs compute (one core, a large model) only well-accepted drafts are
  proposed, and a sequence whose text is not in its context stops paying for rows it throws
  away.
* A draft model's k is priced the same way, its k draft steps (each timed as a share of the
  target's plain step of as many rows) added to the verify step, against a plain decode
  step: a batch that always drafts runs one step without drafts now and then
  (`plain_due`), so the plain step's price is measured, not guessed from speculative ones.
* Off when compute-bound: the step's decode rows (one per stream plus the drafts) stay within
  `max_step_rows` (default 16, one GEMM tile). Draft rows share what is left after every
  stream's own row, so with 16 or more streams decoding nobody speculates.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

from . import ngram_lookup

METHODS = ("none", "ngram", "draft")
DEFAULT_NUM_TOKENS = 5
DEFAULT_MAX_STEP_ROWS = 16  # one tile of the fused step's GEMM
EMA_WEIGHT = 0.3  # weight of the newest step in a sequence's acceptance average
COST_WINDOW = 15  # steps of a row count whose median prices it
RECOVERY = 0.05  # per step without drafts: how far the average moves back towards 1
PLAIN_EVERY = 64  # timed decode steps after which a draft model's plain step is timed again


@dataclass(frozen=True)
class SpecConfig:
    """`method`: "none" | "ngram" | "draft" (a draft model at `draft_model`, draft_proposer.py).
    `num_tokens`: the most tokens a sequence proposes per step. `ngram_min`/`ngram_max`: the
    n-gram lengths looked up. `max_step_rows`: speculation only while a step's decode rows,
    drafts included, stay within this many."""

    method: str = "none"
    num_tokens: int = DEFAULT_NUM_TOKENS
    ngram_min: int = 2
    ngram_max: int = 32
    max_step_rows: int = DEFAULT_MAX_STEP_ROWS
    draft_model: str | None = None

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    def check(self) -> SpecConfig:
        """Raise ValueError for settings that cannot run; returns self."""
        if self.method not in METHODS:
            raise ValueError(f"speculative.method {self.method!r} is not one of {', '.join(METHODS)}")  # fmt: skip
        if self.method == "draft" and not self.draft_model:
            raise ValueError("speculative.method 'draft' needs speculative.draft_model (a path)")
        if self.num_tokens < 1:
            raise ValueError(f"speculative.num_tokens must be >= 1, got {self.num_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(
                f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min} and {self.ngram_max}"
            )
        if self.max_step_rows < 2:
            raise ValueError(f"speculative.max_step_rows must be >= 2, got {self.max_step_rows}")
        return self


class SpecPolicy:
    """Per-sequence k and the step's draft-row share, from a `SpecConfig`."""

    def __init__(self, config: SpecConfig) -> None:
        self.config = config.check()
        self.costs: dict[int, float] = {}  # decode rows -> seconds of such a step (median)
        self.cost_samples: dict[int, deque[float]] = {}  # decode rows -> its last steps' seconds
        self.classes = ngram_lookup.ClassAcceptance()  # n-gram drafts' acceptance per match class
        # A draft model's step as a share of the target's one-row-per-stream step, measured
        # side by side (draft_proposer.py sets it; load slows both alike, so it does not go
        # stale while the draft is priced out): k drafts cost k such shares.
        self.draft_ratio = 0.0
        self.timed = 0  # decode-only steps timed
        self.timed_at: dict[int, int] = {}  # decode rows -> `timed` when last timed

    def plain_due(self, num_decodes: int) -> bool:
        """Whether the step of `num_decodes` streams should go without drafts, to time a plain
        decode step of that many rows: a draft model's k weighs its k draft steps and the
        verify step against it, and a batch whose every step drafts never times one (the
        cost table then priced it as the smallest step it had, a speculative one: drafting
        never stopped where it lost, 0.87x at 4 streams on one core). Timed again every
        PLAIN_EVERY timed steps, as the machine's load moves. Not for n-gram speculation,
        whose sequences without a match decode plainly anyway."""
        if self.config.method != "draft" or num_decodes < 1:
            return False
        at = self.timed_at.get(num_decodes)
        return at is None or self.timed - at >= PLAIN_EVERY

    def draft_rows_each(self, num_decodes: int) -> int:
        """Draft rows each of `num_decodes` decoding streams may add this step (0: off)."""
        if num_decodes < 1:
            return 0
        return max(0, (self.config.max_step_rows - num_decodes) // num_decodes)

    def propose(
        self, ids: Seq[int] | None, k: int, seq: Any = None, num_decodes: int = 1
    ) -> list[int]:
        """At most `k` n-gram drafts for a sequence whose ids are `ids`: copied from after the
        longest earlier occurrence of its last tokens (ngram_lookup.py), as many as pay by
        the measured step costs at the acceptance of the match's class, averaged with the
        sequence's own record (`seq.acceptance`). `seq` (a Sequence) also carries the last
        draft, settled here against the ids that followed it into the class's record, and its
        ids as searched (`seq.ngram_hay`, appended to each step: `ids` is not read then)."""
        c = self.config
        if seq is not None:
            if seq.ngram_hay is None:
                seq.ngram_hay = ngram_lookup.Haystack()
            ids = seq.ngram_hay.sync(seq.prompt_ids, seq.output_ids)
        assert ids is not None
        if seq is not None and seq.ngram_draft is not None:
            settled = seq.ngram_draft.accepted(ids)
            if settled is not None:
                self.classes.add(seq.ngram_draft.cls, *settled)
            seq.ngram_draft = None
        if isinstance(ids, ngram_lookup.Haystack):
            draft, match = ngram_lookup.propose_in(ids, k, c.ngram_min, c.ngram_max)
        else:
            draft, match = ngram_lookup.propose(ids, k, c.ngram_min, c.ngram_max)
        if match is not None:
            cls = ngram_lookup.match_class(match)
            if seq is not None:
                seq.ngram_cursor = ngram_lookup.Cursor(match.follow, len(ids))
        else:  # no suffix recurs: pick the copy up where it was (ngram_lookup.realign)
            follow = None
            if seq is not None and seq.ngram_cursor is not None and k >= 1:
                follow = ngram_lookup.realign(ids, seq.ngram_cursor)  # ids: its Haystack
            if follow is None:
                return []
            seq.ngram_cursor = ngram_lookup.Cursor(follow, len(ids))
            draft, cls = ids[follow : follow + k], ngram_lookup.REALIGNED
        a = self.classes.estimate(cls)
        if seq is not None and seq.acceptance is not None:
            a = (a + seq.acceptance) / 2
        draft = draft[: best_k(a, len(draft), num_decodes, self.step_cost)]
        if seq is not None and draft:
            seq.ngram_draft = ngram_lookup.OpenDraft(len(ids), tuple(draft), cls)
        elif seq is not None:  # priced out: its record creeps back, so it tries again later
            seq.acceptance = self.recovered(seq.acceptance)
        return draft

    def wanted(self, acceptance: float | None, num_decodes: int = 1, cap: int | None = None) -> int:
        """The k a sequence asks for, at most `cap`: the one that gives the most tokens per
        second by its acceptance and the measured step costs (`best_k`); num_tokens before
        it has a record."""
        top = min(self.config.num_tokens, self.config.num_tokens if cap is None else cap)
        if acceptance is None or top < 1 or self.config.method == "ngram":
            return max(top, 0)  # n-gram drafts are priced per match, in `propose`
        if not self.draft_ratio:
            return best_k(acceptance, top, num_decodes, self.step_cost)
        draft_step = self.draft_ratio * self.step_cost(num_decodes)

        def cost(rows: int) -> float:  # the target's step plus k steps of the draft
            return self.step_cost(rows) + draft_step * (rows // num_decodes - 1)

        return best_k(acceptance, top, num_decodes, cost)

    def observe_step(self, rows: int, seconds: float) -> None:
        """A step of `rows` decode rows (no prompt rows) took `seconds`: the cost table, the
        median of each row count's last COST_WINDOW steps (an average let one step slowed by
        another process price the drafts up or down for several steps after it)."""
        self.timed += 1
        self.timed_at[rows] = self.timed
        window = self.cost_samples.setdefault(rows, deque(maxlen=COST_WINDOW))
        window.append(seconds)
        self.costs[rows] = statistics.median(window)

    def step_cost(self, rows: int) -> float:
        """The measured seconds of a decode step of `rows` rows; a size not measured yet costs
        what the largest measured size below it does (optimistic: it gets tried, then
        measured), 1.0 before any."""
        if rows in self.costs:
            return self.costs[rows]
        below = [n for n in self.costs if n < rows]
        return self.costs[max(below)] if below else min(self.costs.values(), default=1.0)

    @staticmethod
    def recovered(acceptance: float | None) -> float | None:
        """A step without drafts moves the average a little towards 1, so a sequence priced
        out of speculating tries again now and then (its text may have turned to copying)."""
        return None if acceptance is None else acceptance + RECOVERY * (1 - acceptance)

    @staticmethod
    def updated(acceptance: float | None, proposed: int, accepted: int) -> float:
        """The per-token acceptance average after a step: of the drafts checked (every one up
        to the first rejected), the share accepted."""
        checked = accepted + (accepted < proposed)
        share = accepted / checked
        if acceptance is None:
            return share
        return (1 - EMA_WEIGHT) * acceptance + EMA_WEIGHT * share


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a step with k drafts yields when each is accepted with probability
    `acceptance` until the first rejection: 1 + a + ... + a^k."""
    return sum(acceptance**i for i in range(k + 1))


def best_k(acceptance: float, top: int, num_decodes: int, cost) -> int:
    """The k in 0..top with the most expected tokens per second of step, every one of
    `num_decodes` streams taking as many (`cost(rows)`: a step's seconds)."""
    rate = [expected_tokens(acceptance, k) / cost(num_decodes * (1 + k)) for k in range(top + 1)]
    return max(range(top + 1), key=lambda k: (rate[k], -k))
