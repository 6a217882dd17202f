"""The adaptive prompt budget: how many prompt rows a step that also decodes may take (torch-free)."""

from __future__ import annotations

import pytest
from syshax.shared.sampling import SamplingParams
from syshax.workers.engine.outputs import EngineStats
from syshax.workers.engine.prompt_budget import (
    FIRST_ROWS,
    MIN_PROMPT_ROWS,
    PromptBudget,
    typical_line,
)
from syshax.workers.engine.scheduler import Scheduler

from ...lightness import assert_loads_without

# The 1B shape on 2 cores, roughly: a step is 15 ms of weight streaming plus 4 ms a row.
CPU_1B = (0.015, 0.004)


def test_the_rows_keep_a_step_within_stretch_times_its_decodes():
    budget = PromptBudget(max_rows=64, stretch=2.0)
    # 4 decodes: 31 ms alone, so 31 ms of prompt rows = 7 rows (7.75 rounded down)
    assert budget.rows(4, CPU_1B) == 7
    # 16 decodes: 79 ms alone, room for 19 rows; more streams, more rows
    assert budget.rows(16, CPU_1B) == 19
    base, per_row = CPU_1B
    for decodes in (1, 2, 4, 8, 16, 32):
        rows = budget.rows(decodes, CPU_1B)
        alone = base + per_row * decodes
        assert base + per_row * (decodes + rows) <= 2.0 * alone + 1e-12
        assert base + per_row * (decodes + rows + 1) > 2.0 * alone  # and no fewer than fit


def test_the_rows_are_clamped_to_the_floor_and_the_cap():
    assert PromptBudget(max_rows=64, stretch=1.0).rows(4, CPU_1B) == MIN_PROMPT_ROWS
    assert PromptBudget(max_rows=64, stretch=1.1).rows(1, CPU_1B) == MIN_PROMPT_ROWS
    assert PromptBudget(max_rows=10, stretch=4.0).rows(16, CPU_1B) == 10
    assert PromptBudget(max_rows=2, stretch=1.0).rows(4, CPU_1B) == 2  # the cap wins
    assert PromptBudget(max_rows=None, stretch=3.0).rows(16, CPU_1B) == 39


def test_without_a_time_rule_the_cap_alone_applies():
    assert PromptBudget(max_rows=64, stretch=None).rows(4, CPU_1B) == 64
    assert PromptBudget(max_rows=None, stretch=None).rows(4, CPU_1B) is None
    assert PromptBudget(max_rows=64, stretch=2.0).rows(4, (0.02, 0.0)) == 64  # a flat step
    assert PromptBudget(max_rows=64, stretch=2.0).rows(0, CPU_1B) == 64  # no decodes


def test_no_step_timed_yet_gives_one_tile_within_the_cap():
    assert PromptBudget(max_rows=64, stretch=2.0).rows(4, None) == FIRST_ROWS
    assert PromptBudget(max_rows=8, stretch=2.0).rows(4, None) == 8
    assert PromptBudget(max_rows=None, stretch=2.0).rows(4, None) == FIRST_ROWS


def test_the_typical_line_goes_through_each_row_counts_median():
    assert typical_line([]) is None
    assert typical_line([(4, 0.030)]) == pytest.approx((0.015, 0.015 / 4))  # half grows
    line = [(r, 0.015 + 0.004 * r) for r in (4, 4, 4, 8, 8, 8, 20, 20, 20)]
    assert typical_line(line) == pytest.approx((0.015, 0.004))
    slowed = [*line, (8, 0.5), (20, 0.9)]  # one slow step at two row counts
    assert typical_line(slowed) == pytest.approx((0.015, 0.004))
    assert typical_line([(4, 0.05), (8, 0.03)]) == pytest.approx((0.04, 0.0))  # never < 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_rows": 0}, "prompt_rows_while_decoding must be >= 1"),
        ({"stretch": 0.5}, "prompt_stretch must be >= 1.0"),
        ({"stretch": float("nan")}, "prompt_stretch must be >= 1.0"),
    ],
)
def test_bad_limits_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PromptBudget(**kwargs)


def _add(s: Scheduler, rid: str, n: int) -> None:
    s.add(s.new_sequence(rid, list(range(1, n + 1)), SamplingParams(max_tokens=32)))


def _step(s: Scheduler) -> list[tuple[str, int]]:
    step = s.schedule()
    n = len(step.sampling)
    s.update(step, [7] * n, [None] * n)
    return [(c.seq.request_id, c.length) for c in step.chunks]


def test_the_scheduler_sizes_prompt_chunks_from_the_engines_step_times():
    s = Scheduler(
        max_num_seqs=8,
        max_model_len=256,
        max_num_batched_tokens=128,
        block_size=16,
        prefix_caching=False,
        prompt_rows_while_decoding=64,
        prompt_stretch=2.0,
    )
    stats = EngineStats()
    s.step_model = lambda: typical_line(stats.steps.samples)  # as EngineCore wires it
    for rid in "abcd":
        _add(s, rid, 8)
    assert _step(s) == [(r, 8) for r in "abcd"]  # no decodes: the whole budget
    _add(s, "p", 100)
    # decodes, but no step timed yet: one tile's worth
    assert _step(s) == [*((r, 1) for r in "abcd"), ("p", FIRST_ROWS)]
    for rows in (4, 8, 4, 8, 20):  # timed steps of 15 ms + 4 ms a row
        stats.record(rows - 4, 4, CPU_1B[0] + CPU_1B[1] * rows)
    _add(s, "q", 100)
    # now the model: 4 decodes take 31 ms alone, so p's next chunk is 7 rows and q waits
    assert _step(s) == [*((r, 1) for r in "abcd"), ("p", 7)]
    stats.record(4, 4, 0.5)  # a step slowed by a neighbour does not move the line
    assert _step(s) == [*((r, 1) for r in "abcd"), ("p", 7)]


def test_prompt_budget_loads_without_torch():
    assert_loads_without("import syshax.workers.engine.prompt_budget", ("torch",))
