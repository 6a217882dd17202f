"""How many prompt rows a step that also decodes may take: the adaptive prompt budget.

A step's time is the inter-token gap of every stream it decodes, so a new prompt's chunk
riding in it stretches all of them (on 2 CPU cores a 1B prompt row costs ~4 ms, a 4-stream
decode step ~30 ms). A fixed cap (`prompt_rows_while_decoding`) cannot fit every load: 64
rows doubled a 4-stream step, 16 rows still cost ~50%, while at 16 streams the same 16 rows
add only a fifth and a smaller cap starves the waiting prompts (TTFT).

So the budget follows a target step time, as Sarathi-Serve sizes its token budget and vLLM
caps long prefills, but measured rather than fixed in rows: the engine's step-time model
(`typical_line`: `base + per_row x rows` fitted to the median time of each row count among
its recent decoding steps, so a step slowed by a neighbour on shared cores does not tilt it)
predicts the decodes' own step `t_d`, and the prompt rows may stretch it to `stretch x t_d`:

    rows = (stretch - 1) x t_d / per_row,   clamped to [MIN_PROMPT_ROWS, max_rows]

A stream's worst gap is then about `stretch` times its usual one at any load: few rows while
a few streams decode (the step is short), more while many do (it is long anyway), so the
waiting prompts keep moving. A step without decodes is not limited here: a prompt alone
still takes the whole token budget (TTFT). Before any decoding step is timed, such a step
takes FIRST_ROWS. Torch-free, like the scheduler that asks it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from statistics import median

# A step with decodes always takes at least this many prompt rows (when prompts wait), so
# a prompt arriving among many streams still progresses by a useful amount each step.
MIN_PROMPT_ROWS = 4

# A decoding step's prompt rows before any step was timed (the first steps of a worker).
FIRST_ROWS = 16

StepModel = tuple[float, float]  # (base seconds, seconds per row), StepTimes.model's


@dataclass(frozen=True)
class PromptBudget:
    """`max_rows`: the most prompt rows a decoding step takes (None: no cap). `stretch`: how
    much longer than the decodes alone such a step may run (None: no time rule, the cap
    alone; 1.0 = only MIN_PROMPT_ROWS)."""

    max_rows: int | None = None
    stretch: float | None = None

    def __post_init__(self) -> None:
        if self.max_rows is not None and self.max_rows < 1:
            raise ValueError(f"prompt_rows_while_decoding must be >= 1, got {self.max_rows}")
        if self.stretch is not None and not self.stretch >= 1.0:
            raise ValueError(f"prompt_stretch must be >= 1.0, got {self.stretch}")

    def rows(self, decode_rows: int, model: StepModel | None) -> int | None:
        """The prompt rows a step holding `decode_rows` rows of decodes (drafts included)
        may add; None: no limit beyond the step's token budget."""
        if self.stretch is None or decode_rows < 1:
            return self.max_rows
        if model is None:  # no decoding step timed yet: one row tile's worth
            return FIRST_ROWS if self.max_rows is None else min(FIRST_ROWS, self.max_rows)
        base, per_row = model
        if per_row <= 0:  # a flat step (an accelerator's): rows cost nothing measurable
            return self.max_rows
        decodes_alone = base + per_row * decode_rows
        rows = max(int((self.stretch - 1.0) * decodes_alone / per_row), MIN_PROMPT_ROWS)
        return rows if self.max_rows is None else min(rows, self.max_rows)


def typical_line(samples: Iterable[tuple[int, float]]) -> StepModel | None:
    """(base seconds, seconds per row) of recent steps given as (rows, seconds): least squares
    through the median time of each row count, weighted by its count. Medians, because on
    shared cores a few steps run several times slower than the rest, and a plain fit lets
    them raise the line, which would let more prompt rows into every step and slow the
    next ones further. With one row count, half of its step is taken to grow with the rows
    (StepTimes.model's guess; about right on a CPU, where a 4-row step is half weights
    streamed and half rows computed). None without samples."""
    groups: dict[int, list[float]] = {}
    for rows, seconds in samples:
        groups.setdefault(rows, []).append(seconds)
    if not groups:
        return None
    if len(groups) == 1:  # no slope to read yet: half the step grows with the rows
        ((rows, times),) = groups.items()
        return median(times) / 2, median(times) / (2 * rows)
    points = [(rows, median(times), len(times)) for rows, times in groups.items()]
    weight = sum(w for _, _, w in points)
    mean_x = sum(x * w for x, _, w in points) / weight
    mean_y = sum(y * w for _, y, w in points) / weight
    var = sum(w * (x - mean_x) ** 2 for x, _, w in points)
    slope = max(sum(w * (x - mean_x) * (y - mean_y) for x, y, w in points) / var, 0.0)
    return max(mean_y - slope * mean_x, 0.0), slope
