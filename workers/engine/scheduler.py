"""The scheduler under every engine: which token rows the next step computes, and what its
sampled tokens do. Torch-free on purpose (nano-vllm's shape): it is tested without a model,
and an engine is this scheduler plus a runner that turns a `ScheduledStep` (scheduled_step.py)
into logits.

One rule covers prefill, chunked prefill, resume and decode: a running sequence has rows
`[num_cached, length)` still to compute, and samples a token when a step reaches `length`.
A decode is the case of one row. Each step (vLLM's max_num_batched_tokens):

1. every decoding sequence gets its one row, so streams keep their pace while prompts arrive;
2. sequences part-way through their prompt continue, in arrival order;
3. waiting sequences start (first in, first out) while the token budget, the running limit
   and the KV blocks last: a newcomer first takes the cached blocks its prompt starts with
   (prefix caching), then needs free blocks for the rest of its prompt.

A prompt longer than what is left of the budget is computed in chunks over several steps.
A step that carries decodes takes only the prompt rows its `PromptBudget` allows
(prompt_budget.py): at most `prompt_rows_while_decoding`, and with `prompt_stretch` only as
many as keep the step within that multiple of its decodes' own time, by the engine's
step-time model. A step's time is every running stream's inter-token gap, and a 256-row
prompt chunk on a CPU makes that gap ~1 s (SARATHI's point: bounded chunks keep decodes at
pace). A step without decodes still fills the whole budget.
When a decode finds no free block, the most recently admitted sequence is preempted: its
blocks are freed and it goes back to the head of the queue with the tokens it generated,
to be recomputed (vLLM's recompute preemption). Nothing it streamed is lost or repeated.

With speculation (speculative.py), a decode may carry draft tokens: its chunk computes the
last token's row plus one row per draft, and the runner returns 1 to k+1 verified tokens
for it. The rows of rejected drafts are forgotten (num_cached stops at the last accepted
token) and the blocks only they used are freed at once. Drafts never preempt anyone: they
take the free blocks there are, and the budget left after every stream's own row.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any

from syshax.shared.sampling import SamplingParams

from .block_manager import BlockManager
from .errors import CapacityError, RequestError
from .outputs import SpecCounts, StepOutput
from .prompt_budget import PromptBudget, StepModel
from .scheduled_step import Chunk, ScheduledStep, step_budget
from .sequence import Sequence, make_detokenizer, record_token
from .speculative import SpecConfig, SpecPolicy

DEFAULT_BLOCK_SIZE = 16


class Scheduler:
    def __init__(
        self,
        *,
        max_num_seqs: int,
        max_model_len: int,
        max_num_batched_tokens: int | None = None,
        num_blocks: int | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        prefix_caching: bool = True,
        vocab_size: int | None = None,
        stop_token_ids: frozenset[int] = frozenset(),
        tokenizer=None,
        prompt_rows_while_decoding: int | None = None,
        speculation: SpecConfig | None = None,
        prompt_stretch: float | None = None,
    ):
        """`max_num_batched_tokens`: the step's token budget (default: `step_budget`'s).
        `num_blocks`: KV blocks of `block_size` positions (default: room for every sequence
        at max_model_len). `prompt_rows_while_decoding`: the most prompt rows a step with
        decodes in it takes (None: the rest of the budget). `speculation`: how decodes
        propose draft tokens (None or method "none": they do not). `prompt_stretch`: such a
        step's prompt rows keep it within this multiple of its decodes' time, predicted by
        `step_model` (PromptBudget; None: the cap alone)."""
        self.max_num_batched_tokens = step_budget(
            max_num_seqs, max_num_batched_tokens, prompt_rows_while_decoding
        )
        self.prompt_rows_while_decoding = prompt_rows_while_decoding
        self.prompt_budget = PromptBudget(prompt_rows_while_decoding, prompt_stretch)
        # The step-time model (base s, s per row) the engine fits to its steps; None: none yet.
        self.step_model: Callable[[], StepModel | None] = lambda: None
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self.tokenizer = tokenizer
        self.max_num_seqs = max_num_seqs
        if num_blocks is None:
            num_blocks = max_num_seqs * -(-max_model_len // block_size)
        if num_blocks * block_size < max_model_len:
            raise ValueError(
                f"the KV cache ({num_blocks} blocks of {block_size} = {num_blocks * block_size} "
                f"positions) cannot hold one sequence of max_model_len {max_model_len}"
            )
        self.blocks = BlockManager(num_blocks, block_size, prefix_caching)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # holding KV blocks, in admission order
        self.sequences: dict[str, Sequence] = {}
        self.preemptions = 0
        self.spec = SpecPolicy(speculation) if speculation and speculation.enabled else None
        # A draft model's proposer (draft_proposer.py), set by the engine for method "draft":
        # propose([(seq, k)]) -> [(tokens, q)] batched over sequences, release(seq).
        self.drafter: Any = None
        self.spec_counts = SpecCounts()

    # ---- requests -----------------------------------------------------------------------

    def new_sequence(
        self,
        request_id: str,
        prompt_ids: Seq[int],
        params: SamplingParams,
        output_ids: Seq[int] = (),
    ) -> Sequence:
        """A checked sequence (not yet queued); raises RequestError for a bad request."""
        if request_id in self.sequences:
            raise RequestError(f"request {request_id!r} is already in this engine")
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise RequestError(
                f"prompt has {len(prompt_ids)} tokens; max_model_len is {self.max_model_len} "
                "(the prompt must leave room for at least one generated token)"
            )
        room = self.blocks.num_blocks * self.blocks.block_size
        if len(prompt_ids) + len(output_ids) >= room:
            raise RequestError(
                f"prompt has {len(prompt_ids) + len(output_ids)} tokens; this engine's whole KV "
                f"cache holds {room} positions"
            )
        if self.vocab_size is not None:
            bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise RequestError(
                    f"token id {bad[0]} is outside the vocabulary (size {self.vocab_size})"
                )
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer; this engine was loaded without one")
        seq = Sequence(request_id, list(prompt_ids), params, output_ids=list(output_ids))
        seq.logprobs = [None] * len(seq.output_ids)
        seq.prefill_end = seq.length
        seq.detokenizer = make_detokenizer(self.tokenizer, seq)
        return seq

    def add(self, seq: Sequence) -> None:
        """Queue a sequence to be computed from position 0 (a new or resumed request)."""
        self.sequences[seq.request_id] = seq
        self.waiting.append(seq)

    def add_running(self, seq: Sequence, num_cached: int) -> None:
        """Admit a sequence whose first `num_cached` rows are already computed (a KV import):
        the caller fills its blocks' cache after this returns."""
        if len(self.running) >= self.max_num_seqs:
            raise CapacityError(f"all {self.max_num_seqs} sequences are running")
        if not self.blocks.grow(seq, num_cached + 1):
            raise CapacityError(
                f"no room in the KV cache for {num_cached + 1} positions "
                f"({self.blocks.num_free} blocks free)"
            )
        seq.num_cached = seq.prefill_end = num_cached
        self.running.append(seq)
        self.sequences[seq.request_id] = seq

    def abort(self, request_id: str) -> Sequence | None:
        """Drop a request wherever it is (waiting or running) and free its blocks."""
        seq = self.sequences.pop(request_id, None)
        if seq is None:
            return None
        if seq in self.waiting:
            self.waiting.remove(seq)
        else:
            self._release(seq)
        return seq

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- the step -----------------------------------------------------------------------

    def schedule(self) -> ScheduledStep:
        budget = self.max_num_batched_tokens
        step = ScheduledStep()
        for seq in [s for s in self.running if s.length - s.num_cached == 1]:
            if seq not in self.running:
                continue  # preempted for an earlier decode of this step
            if not self._make_room(seq, seq.length):
                continue  # it preempted itself
            step.chunks.append(Chunk(seq, seq.num_cached, 1))
            budget -= 1
        if self.spec is not None:
            budget -= self._speculate(step.chunks, budget)
        prompts = [s for s in self.running if s.length - s.num_cached > 1]
        # The step model is fitted only when prompt rows could join this step (a prompt under
        # way or waiting), not on every pure decode step.
        if step.chunks and (prompts or self.waiting):
            timed = self.prompt_budget.stretch is not None
            allowed = self.prompt_budget.rows(step.num_rows, self.step_model() if timed else None)
            if allowed is not None:
                budget = min(budget, allowed)
        for seq in prompts:
            if budget <= 0:
                return step
            n = min(seq.length - seq.num_cached, budget)
            step.chunks.append(Chunk(seq, seq.num_cached, n))
            budget -= n
        while budget > 0 and self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            seq.num_cached = self.blocks.match_prefix(seq)
            # Blocks for the whole prompt now, so a prompt never stalls half-computed (two
            # half-computed prompts could each wait for the other's blocks). First in, first
            # out: while the head does not fit, later ones wait behind it.
            if not self.blocks.grow(seq, seq.length):
                self.blocks.release(seq)
                seq.num_cached = 0
                break
            self.waiting.popleft()
            self.running.append(seq)
            n = min(seq.length - seq.num_cached, budget)
            step.chunks.append(Chunk(seq, seq.num_cached, n))
            budget -= n
        return step

    def _speculate(self, decodes: list[Chunk], budget: int) -> int:
        """Give the step's decode chunks draft tokens (within the draft rows the policy allows,
        the budget, max_tokens, max_model_len, the free blocks and a grammar); returns the
        rows added."""
        assert self.spec is not None
        each = min(self.spec.draft_rows_each(len(decodes)), budget // max(len(decodes), 1))
        # A step to be timed (no prompt rows can join) goes plain when the draft's pricing
        # needs a plain step's time (SpecPolicy.plain_due).
        if self.spec.plain_due(len(decodes)) and not self.waiting and all(s.length - s.num_cached == 1 for s in self.running):  # fmt: skip
            each = 0
        added = 0
        wants: list[tuple[Chunk, int]] = []
        for chunk in decodes if each > 0 else ():
            seq = chunk.seq
            p = seq.params
            k = min(
                self.spec.wanted(seq.acceptance, len(decodes), each),
                self.max_model_len - seq.length,
            )
            if p.max_tokens is not None:  # the verified tokens plus the target's own fit
                k = min(k, p.max_tokens - len(seq.output_ids) - 1)
            if k < 1:
                seq.acceptance = self.spec.recovered(seq.acceptance)
                continue
            wants.append((chunk, k))
        if self.drafter is not None:  # a draft model: k small steps batched over sequences
            proposals = self.drafter.propose([(c.seq, k) for c, k in wants])
        else:
            n = len(decodes)
            proposals = [(self.spec.propose(None, k, c.seq, n), None) for c, k in wants]
        for (chunk, _), (draft, q) in zip(wants, proposals, strict=True):
            seq = chunk.seq
            if draft and seq.constraint is not None:  # stop at the first refused token
                keep = seq.constraint.valid_prefix(draft)
                # A sampled draft keeps its refused token: the verifier rejects it (p = 0)
                # and draws from the residual, as the rule needs to keep p exact.
                draft = draft[: keep + (q is not None and keep < len(draft))]
            if draft and not self.blocks.grow(seq, seq.length + len(draft)):
                held = len(seq.block_table) + self.blocks.num_free  # the free blocks there are
                draft = draft[: max(held * self.blocks.block_size - seq.length, 0)]
                self.blocks.grow(seq, seq.length + len(draft))
            if draft:
                chunk.draft = draft
                chunk.draft_q = None if q is None else q[: len(draft)]
                chunk.length += len(draft)
                added += len(draft)
        return added

    def observe_step(self, prompt_rows: int, decode_rows: int, seconds: float) -> None:
        """The engine's measured step time: decode-only steps price speculation's rows."""
        if self.spec is not None and decode_rows and not prompt_rows:
            self.spec.observe_step(decode_rows, seconds)

    def _make_room(self, seq: Sequence, num_tokens: int) -> bool:
        """Blocks for `seq`'s first `num_tokens` positions, preempting the most recently
        admitted sequences while there are none; False if `seq` itself had to go."""
        while not self.blocks.grow(seq, num_tokens):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.num_cached = 0
        seq.prefill_end = seq.length  # recomputed rows count as prompt rows
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def update(
        self,
        step: ScheduledStep,
        tokens: Seq[int],
        logprobs: Seq[float | None],
        tops: Seq[Any] | None = None,
        counts: Seq[int] | None = None,
    ) -> list[StepOutput]:
        """Record a computed step: rows are cached; the i-th chunk of `step.sampling` produced
        `counts[i]` tokens (None: one each), taken in order from `tokens` (`logprobs`, and
        `tops`: its top logprobs, when asked). A chunk with a draft produced its accepted
        drafts then the target's token: rows past the last accepted one are forgotten.
        Finished sequences leave and free their blocks."""
        outs: list[StepOutput] = []
        tops = tops if tops is not None else [None] * len(tokens)
        sampled = iter(zip(tokens, logprobs, tops, strict=True))
        counts_it = iter(counts) if counts is not None else None
        for chunk in step.chunks:
            seq = chunk.seq
            if not chunk.samples:
                seq.num_cached = chunk.start + chunk.length
                self.blocks.cache_full_blocks(seq)
                continue
            n = next(counts_it) if counts_it is not None else 1
            run = [next(sampled) for _ in range(n)]
            if chunk.start >= seq.prefill_end:
                self._count_decode(seq, chunk, n)
            for token, logprob, top in run:
                outs.append(self._record(seq, token, logprob, top))
                if seq.finish_reason is not None:
                    break
            # Every row before the newest token stands (the prompt or the last token, and the
            # drafts accepted); rows of rejected drafts are forgotten, to be written again.
            seq.num_cached = seq.length - 1
            self.blocks.cache_full_blocks(seq)
            if seq.finish_reason is not None:
                self._release(seq)
                self.sequences.pop(seq.request_id, None)
            elif chunk.draft:
                self.blocks.shrink(seq, seq.length)
        return outs

    def _record(self, seq: Sequence, token: int, logprob: float | None, top: Any) -> StepOutput:
        seq.logprobs.append(logprob)
        text = record_token(seq, token, self.stop_token_ids, self.max_model_len)
        index = len(seq.output_ids) - 1
        return StepOutput(seq.request_id, token, text, logprob, index, seq.finish_reason, top)

    def _count_decode(self, seq: Sequence, chunk: Chunk, produced: int) -> None:
        counts = self.spec_counts
        counts.decode_chunks += 1
        counts.decode_tokens += produced
        if chunk.draft:
            counts.proposed += len(chunk.draft)
            counts.accepted += produced - 1
            seq.acceptance = SpecPolicy.updated(seq.acceptance, len(chunk.draft), produced - 1)

    def _release(self, seq: Sequence) -> None:
        self.blocks.release(seq)
        self.running.remove(seq)
        if self.drafter is not None:
            self.drafter.release(seq)
