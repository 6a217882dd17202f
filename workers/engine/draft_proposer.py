"""Speculative decoding with a draft model (`speculative.method: draft`): a small model with the
target's tokenizer, loaded by the same worker on the same device, proposes each stream's k
tokens; the target verifies them in one step of k+1 rows (spec_verify.py).

* The draft runs through the same runners as the target (one native call per draft step on
  the CPU, `FusedRunner`; PyTorch otherwise, `TorchRunner`), with its own paged KV cache and
  its own block pool, as many blocks as the target's (a draft never holds more positions than
  its target does).
* A sequence's draft KV follows the sequence lazily: before drafting, the tokens written by the
  last drafting step are checked against what the target accepted, so the draft KV keeps the
  accepted prefix (a rejection rolls it back) and only the positions not in it are computed.
  A sequence with no draft KV (new, preempted, or handed off from another worker) prefills
  its whole context in the draft first, in pieces of the step's row budget.
* k drafts are k small steps of the draft, each batched over every drafting sequence: the
  first computes each sequence's missing rows up to its last token, the rest one row each.
* Greedy requests draft the draft's argmax; sampled ones draw from the draft's distribution q
  (the request's temperature, top-k and top-p on the draft's logits), and q travels with the
  draft to the verifier, which accepts with min(1, p/q) and otherwise draws from
  norm(max(0, p - q)): the emitted tokens keep the target's distribution.
* The draft's step time, as a share of the target's step of as many rows, is measured and
  priced into each sequence's k (SpecPolicy.draft_ratio).
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import torch

from .block_manager import BlockManager
from .config import read_model_config
from .draft_memory import draft_path
from .errors import EngineError
from .kv_cache import KVCache, dtype_name, fitting
from .loader import resolve_model_path
from .sampler import _filter, token_generator
from .scheduled_step import Chunk, ScheduledStep
from .sequence import Sequence

log = logging.getLogger(__name__)

DRAFT_SALT = 0x5DEECE66D  # the draft's draws use other generators than the verifier's
RATIO_SAMPLES = 32


@dataclass
class _DraftKV:
    """A sequence's place in the draft's cache: positions [0, cached) hold its first `cached`
    tokens; `fed` were written after them by the last drafting step (its drafts but the
    last), to be kept as far as the target accepted them."""

    owner: Sequence
    block_table: list[int] = field(default_factory=list)
    block_keys: list = field(default_factory=list)  # BlockManager's slot; never used here
    cached: int = 0
    fed: list[int] = field(default_factory=list)


class _View:
    """What a runner reads of a sequence (Chunk.token_ids, Chunk.samples, block_table)."""

    __slots__ = ("all_ids", "block_table")

    def __init__(self, ids: list[int], block_table: list[int]) -> None:
        self.all_ids, self.block_table = ids, block_table

    @property
    def length(self) -> int:
        return len(self.all_ids)


class DraftProposer:
    """The draft model's runner, cache and per-sequence state; `propose` drafts for a batch."""

    def __init__(self, runner: Any, budget: int, policy: Any = None) -> None:
        self.runner = runner  # a ModelRunner of the draft model
        self.policy = policy  # the scheduler's SpecPolicy: told what a draft step costs
        self.budget = max(budget, 1)  # rows per draft forward (the fused step's buffers)
        cache = runner.cache
        self.blocks = BlockManager(cache.num_blocks, cache.block_size, prefix_caching=False)
        self.kv: dict[str, _DraftKV] = {}
        # Recent batched draft steps, as shares of the target's step of as many rows: their
        # median prices k (a share, not seconds: a load burst slows both models alike).
        self.ratios: deque[float] = deque(maxlen=RATIO_SAMPLES)
        self.forwards = 0  # draft forwards run, for tests and stats
        self.last_seconds = 0.0  # the last `propose` call's time (the engine's step time adds it)

    # ---- the scheduler's hooks ----------------------------------------------------------

    def release(self, seq: Sequence) -> None:
        """The sequence left the running set (finished, aborted, preempted, exported)."""
        state = self.kv.pop(seq.request_id, None)
        if state is not None:
            self.blocks.release(state)  # type: ignore[arg-type]

    def propose(self, wants: Seq[tuple[Sequence, int]]) -> list[tuple[list[int], Any]]:
        """For each (sequence, k): up to k drafted tokens and their q rows ([n, V] fp32, None
        for a greedy request, whose verification needs none)."""
        started = time.perf_counter()
        try:
            return self._propose(wants)
        finally:
            self.last_seconds = time.perf_counter() - started

    def _propose(self, wants: Seq[tuple[Sequence, int]]) -> list[tuple[list[int], Any]]:
        out: list[tuple[list[int], Any]] = [([], None) for _ in wants]
        live: list[tuple[int, Sequence, int, _DraftKV, _View]] = []
        for i, (seq, k) in enumerate(wants):
            state = self._synced(seq)
            # positions up to L + k - 2: the context and every draft but the last
            if k < 1 or not self.blocks.grow(state, seq.length + k - 1):  # type: ignore[arg-type]
                continue
            live.append((i, seq, k, state, _View(seq.all_ids, state.block_table)))
        if not live:
            return out
        # Step 0: each sequence's rows from its draft KV's end to its last token.
        logits = self._forward([(v, s.cached) for _, _, _, s, v in live])
        drafts: list[list[int]] = [[] for _ in live]
        qs: list[list[torch.Tensor]] = [[] for _ in live]
        active = list(range(len(live)))
        while True:
            for row, n in zip(logits, active, strict=True):
                _, seq, _, _, view = live[n]
                token, q = _draw(row, seq, len(seq.output_ids) + len(drafts[n]))
                drafts[n].append(token)
                if q is not None:
                    qs[n].append(q)
            active = [n for n in active if len(drafts[n]) < live[n][2]]
            if not active:
                break
            for n in active:  # the next input: the token just drafted
                live[n][4].all_ids.append(drafts[n][-1])
            started = time.perf_counter()
            logits = self._forward([(live[n][4], live[n][4].length - 1) for n in active])
            self._observe(time.perf_counter() - started, len(active))
        for n, (i, seq, k, state, _) in enumerate(live):
            state.cached, state.fed = seq.length, drafts[n][: k - 1]
            out[i] = (drafts[n], torch.stack(qs[n]) if qs[n] else None)
        return out

    # ---- internals ------------------------------------------------------------------------

    def _observe(self, seconds: float, rows: int) -> None:
        """A draft step of `rows` rows took `seconds`: the policy's draft share, updated."""
        policy = self.policy
        if policy is None or not policy.costs:  # no target decode step timed yet
            return
        self.ratios.append(seconds / policy.step_cost(rows))
        policy.draft_ratio = statistics.median(self.ratios)

    def _synced(self, seq: Sequence) -> _DraftKV:
        """The sequence's draft state, its cached prefix moved past the fed drafts the target
        accepted (and back before its last token, whose logits the draft needs)."""
        state = self.kv.get(seq.request_id)
        if state is not None and state.owner is not seq:  # the id was reused: start over
            self.release(state.owner)
            state = None
        if state is None:
            state = self.kv[seq.request_id] = _DraftKV(seq)
        if state.fed:
            ids, at = seq.all_ids, state.cached
            n = 0
            while n < len(state.fed) and at + n < len(ids) and ids[at + n] == state.fed[n]:
                n += 1
            state.cached, state.fed = at + n, []
        state.cached = min(state.cached, seq.length - 1)
        return state

    def _forward(self, rows: list[tuple[_View, int]]) -> torch.Tensor:
        """The last row's logits [n, V] of each (view, start): the view's tokens from `start`
        to its end are computed, in forwards of at most `budget` rows."""
        pending = list(enumerate(rows))
        found: dict[int, torch.Tensor] = {}
        while pending:
            chunks, order, rest, room = [], [], [], self.budget
            for n, (view, start) in pending:
                if room <= 0:
                    rest.append((n, (view, start)))
                    continue
                take = min(view.length - start, room)
                chunks.append(Chunk(view, start, take))  # type: ignore[arg-type]
                room -= take
                if start + take < view.length:
                    rest.append((n, (view, start + take)))
                else:
                    order.append(n)
            logits = self.runner.forward.execute(ScheduledStep(chunks))
            self.forwards += 1
            for n, row in zip(order, logits, strict=True):
                found[n] = row
            pending = rest
        return torch.stack([found[n] for n in range(len(rows))]).float().cpu()


def _draw(row: torch.Tensor, seq: Sequence, index: int) -> tuple[int, torch.Tensor | None]:
    """One drafted token for output index `index`: the argmax for a greedy request, else a
    draw from q = the request's temperature/top-k/top-p on the draft's logits (returned)."""
    p = seq.params
    if p.greedy:
        return int(torch.argmax(row)), None
    q = torch.softmax(_filter(row, p), dim=-1)
    gen = token_generator(p.seed ^ DRAFT_SALT, index)
    return int(torch.multinomial(q, 1, generator=gen)), q


# ---- loading ------------------------------------------------------------------------------


def load_drafter(
    opts: Any, target: Any, tokenizer: Any = None, policy: Any = None
) -> DraftProposer:
    """The draft model of `opts.speculative.draft_model`, loaded as the target was (same
    device, kernels and KV dtype), checked to share the target's vocabulary, with a KV cache
    of as many blocks as the target's. Raises EngineError."""
    path = draft_path(opts.speculative)
    draft_config = read_model_config(path)
    check_same_vocab(target, tokenizer, path, draft_config)
    if draft_config.position_limit < target.max_model_len:
        raise EngineError(
            f"draft model {path} runs at most {draft_config.position_limit} positions; the "
            f"target's max_model_len is {target.max_model_len}: lower max_model_len"
        )
    kv_dtype = fitting(draft_config, target.kv_dtype)
    per_block = KVCache.bytes_per_block(draft_config, opts.block_size, kv_dtype)
    draft_opts = dataclasses.replace(
        opts,
        speculative=None,
        max_model_len=target.max_model_len,
        kv_cache_bytes=per_block * target.cache.num_blocks,
        kv_dtype=dtype_name(kv_dtype),
        served_model=None,
        prefix_caching=False,
    )
    from .model_runner import ModelRunner, plan_load

    budget = plan_load(path, draft_opts).budget
    runner = ModelRunner.load(path, draft_opts)
    log.info("draft model %s: %d layers, KV %d blocks", path, draft_config.num_layers, runner.cache.num_blocks)  # fmt: skip
    return DraftProposer(runner, budget, policy)


def check_same_vocab(target: Any, tokenizer: Any, path: Any, draft_config: Any) -> None:
    """The draft must score the target's token ids: same vocabulary size and, where both
    models bring a tokenizer, the same token for every id. EngineError otherwise."""
    size, draft_size = target.config.vocab_size, draft_config.vocab_size
    if size != draft_size:
        raise EngineError(
            f"draft model {path} has a vocabulary of {draft_size} tokens, the target "
            f"{target.model_path} one of {size}: a draft must share the target's tokenizer"
        )
    if resolve_model_path(path) == resolve_model_path(target.model_path):
        return
    from syshax.shared.tokenizer import Tokenizer

    def vocab(where: Any) -> dict | None:
        try:
            return Tokenizer.from_model_path(where).backend.get_vocab(with_added_tokens=True)
        except Exception:  # no tokenizer files: only the size can be compared
            return None

    ours = tokenizer.backend.get_vocab(with_added_tokens=True) if tokenizer else vocab(target.model_path)  # fmt: skip
    theirs = vocab(path)
    if ours is None and theirs is None:
        log.warning("neither %s nor draft %s has a tokenizer: only their vocabulary sizes match", target.model_path, path)  # fmt: skip
        return
    if ours != theirs:
        why = "has no tokenizer to compare" if theirs is None else "has another tokenizer"
        if ours is None:
            why = "has a tokenizer the target lacks"
        raise EngineError(
            f"draft model {path} {why} (target: {target.model_path}); a draft must share "
            "the target's tokenizer (the same token for every id)"
        )
