"""A draft model's k against a plain decode step (speculative.py): k draft steps plus the verify
step are priced against the plain step of as many streams, which the scheduler times by
running a step without drafts when none was timed (or long ago), so a batch whose steps are
compute-bound stops drafting."""

from __future__ import annotations

from syshax.shared.sampling import SamplingParams
from syshax.workers.engine.scheduler import Scheduler
from syshax.workers.engine.speculative import PLAIN_EVERY, SpecConfig, SpecPolicy

DRAFT = SpecConfig(method="draft", num_tokens=5, draft_model="d")


def test_a_compute_bound_batch_stops_drafting_once_its_plain_step_is_timed():
    """4 streams on one core (the 0.87x run): 16 rows cost 2.5 times 4 rows, a draft step
    half a plain one. Priced without the plain step (every step drafted) drafting looked
    worth it; with it, k is 0: 1 token per 0.08 s beats 1.71 per 0.17 s (k=1) and 2.57 per
    0.32 s (k=3)."""
    policy = SpecPolicy(DRAFT)
    for rows, seconds in ((8, 0.13), (12, 0.17), (16, 0.20)):
        policy.observe_step(rows, seconds)
    policy.draft_ratio = 0.5
    assert policy.plain_due(4)
    assert policy.wanted(0.71, 4, 3) > 0  # the plain step guessed from the speculative ones
    policy.observe_step(4, 0.08)
    assert not policy.plain_due(4)
    assert policy.wanted(0.71, 4, 3) == 0
    assert policy.wanted(0.98, 4, 3) == 0  # even near-perfect drafts: 3.9 tokens per 0.32 s
    policy.draft_ratio = 0.1  # a draft 10x cheaper than its target: drafting pays again
    assert policy.wanted(0.9, 4, 3) > 0


def test_a_bandwidth_bound_stream_keeps_drafting():
    """1 stream: extra rows cost nothing, a draft step a fifth of a plain step: k stays high
    (3: 2.57 tokens per 0.08 s)."""
    policy = SpecPolicy(DRAFT)
    for rows in range(1, 7):
        policy.observe_step(rows, 0.05)
    policy.draft_ratio = 0.2
    assert not policy.plain_due(1)
    assert policy.wanted(0.71, 1) == 3


def test_the_plain_step_is_timed_again_every_plain_every_steps():
    policy = SpecPolicy(DRAFT)
    policy.observe_step(2, 0.1)
    for _ in range(PLAIN_EVERY - 1):
        policy.observe_step(6, 0.2)
        assert not policy.plain_due(2)
    policy.observe_step(6, 0.2)
    assert policy.plain_due(2) and policy.plain_due(3)  # 3 streams: never timed
    assert not SpecPolicy(SpecConfig(method="ngram")).plain_due(2)  # n-gram: never asked


class _Drafter:
    def __init__(self):
        self.calls = []

    def propose(self, wants):
        self.calls.append(len(wants))
        return [([1, 2], None) for _ in wants]

    def release(self, seq):
        pass


def _decoding(streams: int) -> Scheduler:
    s = Scheduler(max_num_seqs=4, max_model_len=512, block_size=4,
                  speculation=SpecConfig(method="draft", num_tokens=2, draft_model="d"))  # fmt: skip
    s.drafter = _Drafter()
    for i in range(streams):
        s.add(s.new_sequence(f"r{i}", [4, 5, 6], SamplingParams(temperature=0, max_tokens=400)))
    s.update(s.schedule(), [7] * streams, [None] * streams)  # the prefills
    return s


def _step(s: Scheduler, seconds: float) -> list[int]:
    """One step, every draft accepted; the engine's timing reported; the drafts' lengths."""
    step = s.schedule()
    drafts = [len(c.draft) for c in step.chunks]
    tokens, counts = [], []
    for c in step.sampling:
        tokens += [*c.draft, 9]
        counts.append(len(c.draft) + 1)
    s.update(step, tokens, [None] * len(tokens), counts=counts)
    prompt_rows = step.num_rows - step.decode_rows
    s.observe_step(prompt_rows, step.decode_rows, seconds)
    return drafts


def test_the_scheduler_runs_a_plain_step_when_the_plain_price_is_missing():
    s = _decoding(2)
    assert _step(s, 0.1) == [0, 0] and not any(s.drafter.calls)  # plain: timed at 2 rows
    assert _step(s, 0.1) == [2, 2]  # drafting (rows priced flat)
    for _ in range(PLAIN_EVERY - 1):
        assert _step(s, 0.1) == [2, 2]
    assert _step(s, 0.1) == [0, 0]  # timed again, PLAIN_EVERY steps later
    assert _step(s, 0.1) == [2, 2]


def test_a_step_prompt_rows_may_join_is_not_made_plain():
    """Such a step is not timed, so going plain would buy nothing."""
    s = _decoding(2)
    s.add(s.new_sequence("late", [4] * 10, SamplingParams(temperature=0, max_tokens=5)))
    step = s.schedule()
    assert [len(c.draft) for c in step.chunks if c.draft or c.length == 1] == [2, 2]
