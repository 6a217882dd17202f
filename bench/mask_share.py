"""How much of a constrained step is grammar work (issue 28): the engine as a CPU worker runs it
(the GGUF's blocks, the fused native step) decodes `--streams` greedy requests under a JSON
schema, and every step is split into the sampler's grammar work (llguidance's next-token masks,
their application to the logits, the matchers' advance) and the rest (the model's step). The
grammar share is the most that overlapping the masks with the model's step could gain. Columns:
the medians per step of the whole grammar work and of its parts (`masks`: llguidance's masks
as boolean rows, Constraint.allowed; `advance`: the matchers consume the sampled tokens;
`apply`: the masked fill of the logits), and the grammar's share of all the steps' time.

    python bench/mask_share.py --streams 1,16 --tokens 64 [--model M.gguf]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import PEOPLE_SCHEMA  # noqa: E402 - the schema bench/serve.py --response-format uses
from structured_cost import add_engine_args, cpu_engine  # noqa: E402 - the same engine


class Timed:
    """Wraps a function, adding its wall time to `seconds`."""

    def __init__(self, fn) -> None:
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0


def instrument() -> list[Timed]:
    """Time the grammar's three parts where the sampler calls them."""
    from syshax.workers.engine import constraints, sampler

    timers = []
    for owner, name in ((constraints.Constraint, "allowed"), (constraints.Constraint, "advance"), (sampler, "apply_masks")):  # fmt: skip
        timer = Timed(getattr(owner, name))
        timers.append(timer)
        if owner is sampler:
            setattr(owner, name, timer)
        else:  # a method: keep `self`
            setattr(owner, name, lambda self, *a, _t=timer, **k: _t(self, *a, **k))
    return timers


def run(engine, prompt_ids: list[int], streams: int, tokens: int, timers: list[Timed]):
    """(step seconds, grammar seconds) of each decode step with `streams` rows."""
    from syshax.shared.sampling import SamplingParams

    spec = {"kind": "json_schema", "schema": PEOPLE_SCHEMA}
    for i in range(streams):
        p = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, structured=spec)
        engine.add_request(f"r{i}", prompt_ids, p)
    steps, parts = [], []
    while engine.has_unfinished():
        before = [t.seconds for t in timers]
        t0 = time.perf_counter()
        n = len(engine.step())
        steps.append((n, time.perf_counter() - t0))
        parts.append([t.seconds - b for t, b in zip(timers, before, strict=True)])
    # Decode steps at the full batch only (the prefill steps are another thing).
    full = [(s, p) for (n, s), p in zip(steps, parts, strict=True) if n == streams]
    return [s for s, _ in full], [p for _, p in full]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_engine_args(p)
    args = p.parse_args()
    engine, levels, ids = cpu_engine(args)
    timers = instrument()
    run(engine, ids, 2, 8, timers)  # warm-up: kernels, the grammar's first compile
    print(f"{'streams':>7} {'steps':>5} {'step ms p50':>11} {'grammar ms p50':>14} {'masks':>7} {'advance':>7} {'apply':>7} {'share':>6}")  # fmt: skip
    for level in levels:
        steps, parts = run(engine, ids, level, args.tokens, timers)
        grammar = [sum(p) for p in parts]
        share = sum(grammar) / sum(steps)
        step_ms, grammar_ms = statistics.median(steps) * 1e3, statistics.median(grammar) * 1e3
        each = [statistics.median(p[i] for p in parts) * 1e3 for i in range(len(timers))]
        print(f"{level:>7} {len(steps):>5} {step_ms:>11.2f} {grammar_ms:>14.2f} {each[0]:>7.2f} {each[1]:>7.2f} {each[2]:>7.2f} {share:>6.1%}")  # fmt: skip


if __name__ == "__main__":
    main()
