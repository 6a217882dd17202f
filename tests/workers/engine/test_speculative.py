"""Speculative decoding, the torch-free half: the n-gram proposer, the scheduler's drafts (k,
budget, max_tokens, blocks) and the update that keeps accepted tokens and forgets the rest."""

from __future__ import annotations

import pytest
from syshax.shared.sampling import SamplingParams
from syshax.workers.engine import ngram_lookup
from syshax.workers.engine.scheduler import Scheduler
from syshax.workers.engine.sequence import Sequence
from syshax.workers.engine.speculative import SpecConfig, SpecPolicy, best_k

from ...lightness import assert_loads_without


def _reference_propose(ids, k, min_n, max_n):
    """The longest suffix (max_n down to min_n) seen before; of its occurrences the latest,
    unless another next token follows more of them (then the latest of those)."""
    from collections import Counter

    for n in range(min(max_n, len(ids) - 1), min_n - 1, -1):
        starts = [i for i in range(len(ids) - n - 1, -1, -1) if ids[i : i + n] == ids[-n:]]
        if starts:
            nexts = [ids[i + n] for i in starts]
            counts = Counter(nexts)
            top = max(counts.values())
            at = starts[0] if counts[nexts[0]] == top else starts[[counts[t] for t in nexts].index(top)]  # fmt: skip
            return ids[at + n : at + n + k]
    return []


def ngram_propose(ids, k, min_n, max_n):
    return ngram_lookup.propose(ids, k, min_n, max_n)[0]


def test_speculative_module_imports_no_torch():
    assert_loads_without("import syshax.workers.engine.speculative", ("torch",))


def test_ngram_proposes_what_followed_the_latest_longest_match():
    assert ngram_propose([1, 2, 3, 4, 1, 2], 3, 1, 3) == [3, 4, 1]
    assert ngram_propose([7, 1, 2, 8, 9, 1, 2], 2, 2, 2) == [8, 9]  # the latest match
    assert ngram_propose([1, 2, 5, 3, 2, 1, 2], 2, 1, 2) == [5, 3]  # n=2 beats n=1's later [2]
    assert ngram_propose([1, 2], 2, 1, 2) == [] and ngram_propose([], 2, 1, 2) == []
    # the longest match wins past 4 tokens: [3..8] once, then [5..8] twice more recently
    ids = [3, 4, 5, 6, 7, 8, 90, 5, 6, 7, 8, 91, 5, 6, 7, 8, 92, 3, 4, 5, 6, 7, 8]
    assert ngram_propose(ids, 2, 2, 32) == [90, 5]
    assert ngram_propose(ids, 2, 2, 4) == [92, 3]  # capped at 4: the latest [5..8]


def test_ngram_takes_the_continuation_most_occurrences_share():
    ids = [1, 2, 8, 1, 2, 8, 1, 2, 9, 1, 2]  # after [1, 2]: 8, 8, then 9 (the latest)
    m = ngram_lookup.longest_match(ids, 2, 2)
    assert ids[m.follow] == 8 and (m.n, m.agree, m.seen) == (2, 2, 3)
    tie = [1, 2, 8, 1, 2, 9, 1, 2]  # one each: the latest
    assert ngram_propose(tie, 1, 2, 2) == [9]


def test_ngram_matches_a_plain_search_with_ids_that_straddle_bytes():
    import random

    rng = random.Random(0)
    for _ in range(3000):  # 256 and 65537 make byte patterns that match across two ids
        ids = [rng.choice([1, 2, 3, 256, 257, 65537]) for _ in range(rng.randint(0, 18))]
        k, lo = rng.randint(1, 4), rng.randint(1, 3)
        hi = rng.randint(lo, 5)
        assert ngram_propose(ids, k, lo, hi) == _reference_propose(ids, k, lo, hi)


def test_config_refuses_what_cannot_run():
    with pytest.raises(ValueError, match="draft_model"):
        SpecConfig(method="draft").check()
    with pytest.raises(ValueError, match="not one of"):
        SpecConfig(method="eagle").check()
    with pytest.raises(ValueError, match="num_tokens"):
        SpecConfig(method="ngram", num_tokens=0).check()


def test_k_follows_acceptance_and_the_measured_step_costs():
    policy = SpecPolicy(SpecConfig(method="ngram", num_tokens=5))
    cost = policy.step_cost
    assert best_k(0.6, 5, 1, cost) == 5  # no costs measured: rows look free
    for rows, seconds in ((1, 0.08), (2, 0.08), (3, 0.16), (6, 0.16)):
        policy.observe_step(rows, seconds)
    assert best_k(0.6, 5, 1, cost) == 1  # 1.6 tokens per 0.08 s beats 2.3 per 0.16 s
    assert best_k(0.95, 5, 1, cost) == 5  # 5.3 tokens per 0.16 s
    assert best_k(0.5, 2, 2, cost) == 0  # 2 streams: 4-6 rows cost double
    assert best_k(0.99, 2, 2, cost) == 2
    # n-gram drafts are priced per match in propose: wanted is the cap
    assert policy.wanted(None) == policy.wanted(0.1) == 5 and policy.wanted(0.6, cap=0) == 0
    assert [policy.draft_rows_each(n) for n in (1, 4, 8, 16)] == [15, 3, 1, 0]


def test_a_step_slowed_by_another_process_does_not_reprice_the_rows():
    policy = SpecPolicy(SpecConfig(method="ngram"))
    for _ in range(5):
        policy.observe_step(1, 0.08)
    policy.observe_step(1, 1.5)  # a load spike
    assert policy.step_cost(1) == 0.08
    for _ in range(15):  # the machine got slower for good: the price follows
        policy.observe_step(1, 0.2)
    assert policy.step_cost(1) == 0.2


def test_an_ngram_draft_is_priced_by_its_match_class_and_the_sequence():
    policy = SpecPolicy(SpecConfig(method="ngram", num_tokens=5))
    for rows, seconds in ((1, 0.08), (2, 0.08), (3, 0.16), (6, 0.16)):
        policy.observe_step(rows, seconds)
    ids = [5, 6, 7, 8, 9, 10, 11, 12, 5, 6]  # [5, 6] recurs: class (2, unanimous)
    cls = ngram_lookup.match_class(ngram_lookup.longest_match(ids, 2, 32))
    assert policy.propose(ids, 5) == [7]  # the prior 0.5: one draft pays, six rows do not
    policy.classes.add(cls, 60, 60)  # this class's drafts were all accepted
    assert policy.propose(ids, 5) == [7, 8, 9, 10, 11]
    seq = Sequence("s", list(ids), SamplingParams())
    seq.acceptance = 0.0  # ... but this sequence's were not: the average prices it at 1
    assert policy.propose(seq.all_ids, 5, seq) == [7]
    assert seq.ngram_draft == ngram_lookup.OpenDraft(10, (7,), cls)


def test_the_next_proposal_settles_the_last_draft_into_its_class():
    policy = SpecPolicy(SpecConfig(method="ngram", num_tokens=4))
    seq = Sequence("s", [5, 6, 7, 8, 9, 10, 11, 12, 5, 6], SamplingParams())
    assert policy.propose(seq.all_ids, 4, seq) == [7, 8, 9, 10]
    cls = seq.ngram_draft.cls
    seq.output_ids = [7, 8, 42]  # two accepted, then the target's own token
    policy.propose(seq.all_ids, 4, seq)
    assert policy.classes.counts[cls] == [2.0, 3.0]
    assert ngram_lookup.OpenDraft(5, (1, 2), cls).accepted([0] * 4) is None  # a reset sequence


def test_a_copy_broken_by_a_changed_token_is_picked_up_where_it_was():
    """A sequence copying its prompt fixes one token: no suffix of its ids recurs, so the draft
    comes from the copy's old position, realigned on its last token (a realigned class)."""
    policy = SpecPolicy(SpecConfig(method="ngram", num_tokens=4))
    policy.classes.add(ngram_lookup.REALIGNED, 50, 50)  # drafts of this kind were accepted
    prompt = [1, 2, 3, 4, 5, 66, 7, 8, 9, 10, 11, 12, 90]  # 66: the typo
    seq = Sequence("s", prompt, SamplingParams())
    seq.output_ids = [1, 2, 3]  # copying from the prompt's start
    assert policy.propose(seq.all_ids, 4, seq) == [4, 5, 66, 7]
    seq.output_ids = [1, 2, 3, 4, 5, 6]  # 4 and 5 accepted, 6 (not 66) is the target's own
    assert ngram_lookup.longest_match(seq.all_ids, 2, 32) is None  # [5, 6] never occurred
    assert policy.propose(seq.all_ids, 4, seq) == []  # 6 is nowhere: nothing to realign on
    seq.output_ids = [1, 2, 3, 4, 5, 6, 7]  # ... and 7 follows: the copy goes on after it
    assert policy.propose(seq.all_ids, 4, seq) == [8, 9, 10, 11]
    assert seq.ngram_draft.cls == ngram_lookup.REALIGNED
    # Only near where the copy would be: a sequence with no copy position has no draft.
    fresh = Sequence("f", prompt, SamplingParams())
    fresh.output_ids = [1, 2, 3, 4, 5, 6, 7]
    assert policy.propose(fresh.all_ids, 4, fresh) == []


def test_realign_looks_only_near_the_expected_position():
    hay = ngram_lookup.Haystack().sync([9, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [7])
    # The last id (7) was expected at 7 (copy position 7 when 16 ids were held, one added).
    assert ngram_lookup.realign(hay, ngram_lookup.Cursor(7, 16)) == 8
    # Expected far from any 7 (window: 3 before, 10 after): nothing.
    assert ngram_lookup.realign(hay, ngram_lookup.Cursor(15 + 3, 16)) is None
    # 9 occurs at 0 and 9: the nearer to the expected position wins.
    hay9 = ngram_lookup.Haystack().sync([9, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [9])
    assert ngram_lookup.realign(hay9, ngram_lookup.Cursor(2, 14)) == 1
    assert ngram_lookup.realign(hay9, ngram_lookup.Cursor(8, 14)) == 10


def test_acceptance_counts_the_drafts_checked_and_recovers_when_idle():
    assert SpecPolicy.updated(None, 4, 2) == 2 / 3  # 2 accepted, the 3rd rejected
    assert SpecPolicy.updated(None, 4, 4) == 1.0
    assert SpecPolicy.updated(None, 4, 0) == 0.0
    assert 0.0 < SpecPolicy.recovered(0.0) < SpecPolicy.recovered(SpecPolicy.recovered(0.0))


def _sched(spec: SpecConfig | None, seqs: int = 4, budget: int = 64, blocks: int | None = None):
    return Scheduler(
        max_num_seqs=seqs,
        max_model_len=4 * blocks if blocks else 256,
        max_num_batched_tokens=budget,
        block_size=4,
        num_blocks=blocks,
        speculation=spec,
    )


REPEAT = [5, 6, 7, 8, 9, 10, 11, 12, 5, 6]  # the n-gram [5, 6] proposes 7, 8, ...


def _prefill(s: Scheduler, rids: str, prompt=REPEAT, **params):
    """Prompts `prompt` for each of `rids` prefilled in one step, each sampling 7."""
    params.setdefault("max_tokens", 32)
    for rid in rids:
        s.add(s.new_sequence(rid, list(prompt), SamplingParams(temperature=0, **params)))
    step = s.schedule()
    assert len(step.sampling) == len(rids)
    s.update(step, [7] * len(rids), [None] * len(rids))
    return s.sequences[rids[-1]]


def test_a_decode_carries_a_draft_and_keeps_only_accepted_rows():
    s = _sched(SpecConfig(method="ngram", num_tokens=4))
    seq = _prefill(s, "a")
    step = s.schedule()
    (chunk,) = step.chunks
    assert chunk.draft == [8, 9, 10, 11] and chunk.length == 5
    assert chunk.token_ids == [7, 8, 9, 10, 11] and chunk.start == seq.num_cached == 10
    assert len(seq.block_table) == 4  # room for positions 0..14
    outs = s.update(step, [8, 9, 42], [None] * 3, counts=[3])  # 2 accepted, then the target's
    assert [o.token_id for o in outs] == [8, 9, 42] and [o.index for o in outs] == [1, 2, 3]
    assert seq.output_ids == [7, 8, 9, 42] and seq.num_cached == seq.length - 1 == 13
    assert len(seq.block_table) == 4  # 14 positions still need 4 blocks
    assert s.spec_counts.proposed == 4 and s.spec_counts.accepted == 2
    assert seq.acceptance == 2 / 3


def test_rejected_rows_free_their_blocks_and_nothing_leaks():
    s = _sched(SpecConfig(method="ngram", num_tokens=8), blocks=16)
    seq = _prefill(s, "a", prompt=[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 5, 6])
    step = s.schedule()
    assert len(step.chunks[0].draft) == 8 and len(seq.block_table) == 6  # 22 positions
    s.update(step, [99], [None], counts=[1])  # every draft rejected
    assert seq.num_cached == 14 and len(seq.block_table) == 4  # 15 positions: 4 blocks
    s.abort("a")
    assert s.blocks.num_free == 16


def test_max_tokens_is_never_exceeded_and_stop_mid_run_discards_the_rest():
    s = _sched(SpecConfig(method="ngram", num_tokens=8))
    seq = _prefill(s, "a", max_tokens=4)
    step = s.schedule()
    assert step.chunks[0].draft == [8, 9]  # 1 generated + 2 drafts + the target's = 4
    outs = s.update(step, [8, 9, 10], [None] * 3, counts=[3])
    assert [o.token_id for o in outs] == [8, 9, 10] and outs[-1].finish_reason == "length"
    assert "a" not in s.sequences and s.blocks.num_free == s.blocks.num_blocks
    t = _sched(SpecConfig(method="ngram", num_tokens=4))
    seq = _prefill(t, "b", stop_token_ids=[9])
    step = t.schedule()
    outs = t.update(step, [8, 9, 10], [None] * 3, counts=[3])
    assert [o.token_id for o in outs] == [8, 9] and outs[-1].finish_reason == "stop"
    assert seq.output_ids == [7, 8, 9] and t.blocks.num_free == t.blocks.num_blocks


def test_speculation_is_off_when_the_step_is_compute_bound():
    s = _sched(SpecConfig(method="ngram", num_tokens=4, max_step_rows=4), seqs=4)
    _prefill(s, "abcd")
    step = s.schedule()
    assert len(step.chunks) == 4 and all(not c.draft for c in step.chunks)
    s2 = _sched(SpecConfig(method="ngram", num_tokens=4, max_step_rows=8), seqs=4)
    _prefill(s2, "ab")
    step = s2.schedule()
    assert [len(c.draft) for c in step.chunks] == [3, 3]  # (8 - 2) // 2 each


def test_drafts_take_only_free_blocks_never_preempting():
    s = _sched(SpecConfig(method="ngram", num_tokens=8), blocks=8)
    seq = _prefill(s, "a")  # 11 positions: 3 blocks
    other = Sequence("other", [1] * 16, SamplingParams())
    assert s.blocks.grow(other, 16)  # 4 blocks elsewhere: one block left
    step = s.schedule()
    assert step.chunks[0].draft == [8, 9, 10, 11, 12]  # positions up to 15: 4 blocks
    assert s.preemptions == 0 and len(seq.block_table) == 4 and s.blocks.num_free == 0


def test_a_grammar_cuts_the_draft_at_the_first_refused_token():
    class Matcher:  # allows two more tokens
        def valid_prefix(self, tokens):
            return min(2, len(tokens))

    s = _sched(SpecConfig(method="ngram", num_tokens=4))
    seq = _prefill(s, "a")
    seq.constraint = Matcher()
    assert s.schedule().chunks[0].draft == [8, 9]


def test_without_speculation_nothing_changes():
    s = _sched(None)
    _prefill(s, "a")
    step = s.schedule()
    assert step.chunks[0].length == 1 and not step.chunks[0].draft


def test_the_config_turns_it_on_for_the_native_engine_only():
    from syshax.shared.config import Config, ConfigError, config_from_dict
    from syshax.workers.settings import WorkerOverrides, WorkerSettings

    cfg = config_from_dict({"speculative": {"method": "ngram", "num_tokens": 3}})
    cpu = WorkerOverrides(roles="decode", device="cpu", device_class="cpu")
    spec = WorkerSettings.from_config(cfg, cpu).speculative
    assert spec == SpecConfig(method="ngram", num_tokens=3)
    echo = WorkerOverrides(roles="decode", device="cpu", device_class="cpu", engine="echo")
    assert WorkerSettings.from_config(cfg, echo).speculative is None
    assert WorkerSettings.from_config(Config(), cpu).speculative is None
    with pytest.raises(ConfigError, match="draft_model"):
        config_from_dict({"speculative": {"method": "draft"}})
