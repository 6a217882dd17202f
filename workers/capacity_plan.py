"""What a host can serve with and without CPU decode offload: the model behind `syshax plan`.

Pure arithmetic, torch-free (the numbers come from an accelerator profile, a CPU step probe
or the user). Closed-loop saturation of a workload of `input_len`-token prompts and
`output_len`-token answers:

* The xPU decodes `slots` streams; a decode step takes the profile's time at that batch and the
  workload's mean context (`input_len + output_len / 2`), plus the worker's own cost per step
  around the device (`overhead_s + overhead_per_row_s * slots`). It also prefills every request, its own and the CPU's:
  each prompt adds `input_len / prefill_tokens_per_s` (scaled) to some step. With `k` the
  decode rate (tokens/s) and `p` one prefill's time, requests complete at (T_xpu + T_cpu) /
  output_len per second, so the xPU decodes a fraction 1 - (T_xpu + T_cpu) p / output_len of
  the time:  T_xpu = k (1 - T_cpu p / L) / (1 + k p / L),  L = output_len.
* A CPU decode worker steps `base + per_row * rows` seconds (measured by the probe:
  workers/cpu/step_probe.py); its streams see that step as their inter-token latency, and its
  slow steps `tail` times it. With an SLO the worker runs the most streams whose tail latency
  stays within it (the dispatcher's SLO rule does the same with live measurements); without,
  its `max_streams`.
* `farm_tps`, when known, caps the total: the tokens/s the gateway, broker and workers can
  stream at all on this host (`bench/serve.py --launch echo` measures it).

Where this is wrong is said in docs/benchmarks.md (plan vs bench/hetero.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .accelerator_profiles import AcceleratorProfile, ModelScale


@dataclass(frozen=True)
class Workload:
    input_len: int
    output_len: int

    def __post_init__(self) -> None:
        if self.input_len < 1 or self.output_len < 2:
            raise ValueError("input_len must be >= 1 and output_len >= 2")

    @property
    def mean_context(self) -> float:
        return self.input_len + self.output_len / 2


@dataclass(frozen=True)
class StepCurve:
    """One CPU decode worker's step time: `base_s + per_row_s * rows`; `tail` = slow steps
    over typical ones (p99 / median of the probe's steps, >= 1)."""

    base_s: float
    per_row_s: float
    tail: float = 1.0

    def step_s(self, rows: int) -> float:
        return self.base_s + self.per_row_s * rows

    @classmethod
    def fit(cls, points: Iterable[tuple[int, float]], tail: float = 1.0) -> StepCurve:
        """Least squares over (rows, seconds); one point gives a flat curve."""
        pts = list(points)
        if not pts:
            raise ValueError("no step times to fit")
        n = len(pts)
        mx = sum(r for r, _ in pts) / n
        my = sum(s for _, s in pts) / n
        var = sum((r - mx) ** 2 for r, _ in pts)
        slope = sum((r - mx) * (s - my) for r, s in pts) / var if var else 0.0
        slope = max(slope, 0.0)
        return cls(base_s=max(my - slope * mx, 0.0), per_row_s=slope, tail=max(tail, 1.0))


@dataclass(frozen=True)
class CpuLayout:
    """`workers` CPU decode workers of `threads` threads each, and their measured curve."""

    workers: int
    threads: int
    curve: StepCurve
    max_streams: int  # per worker: cpu_max_batch_size

    def streams_at_slo(self, slo_s: float | None) -> int:
        """Streams one worker runs: the most whose tail latency keeps the SLO (0 = none)."""
        if slo_s is None:
            return self.max_streams
        best = 0
        for rows in range(1, self.max_streams + 1):
            if self.curve.step_s(rows) * self.curve.tail <= slo_s:
                best = rows
        return best

    def tokens_per_s(self, slo_s: float | None) -> float:
        rows = self.streams_at_slo(slo_s)
        return self.workers * rows / self.curve.step_s(rows) if rows else 0.0


@dataclass(frozen=True)
class XpuModel:
    profile: AcceleratorProfile
    scale: ModelScale | float
    slots: int
    # The worker's own cost per step outside the device (its loop, scheduling, publishing the
    # tokens): base + per_row * rows seconds.
    overhead_s: float = 0.0
    overhead_per_row_s: float = 0.0

    def decode_step_s(self, w: Workload) -> float:
        ctx = int(self.slots * w.mean_context)
        device = self.profile.step_seconds(0, self.slots, ctx, self.scale)
        return device + self.overhead_s + self.overhead_per_row_s * self.slots

    def prefill_s(self, w: Workload) -> float:
        """What one prompt adds to the step it is computed in."""
        ctx = int(self.slots * w.mean_context)
        with_prompt = self.profile.step_seconds(w.input_len, self.slots, ctx, self.scale)
        return with_prompt - self.profile.step_seconds(0, self.slots, ctx, self.scale)

    def tokens_per_s(self, w: Workload, cpu_tps: float = 0.0) -> float:
        """Saturated decode tokens/s while it also prefills for `cpu_tps` CPU tokens/s."""
        k = self.slots / self.decode_step_s(w)
        p, L = self.prefill_s(w), w.output_len
        return max(k * (1 - cpu_tps * p / L) / (1 + k * p / L), 0.0)


@dataclass(frozen=True)
class Prediction:
    layout: CpuLayout | None
    xpu_tps: float
    cpu_tps: float
    cpu_streams: int  # all workers together
    cpu_itl_s: float | None  # typical inter-token latency of a CPU stream
    cpu_itl_tail_s: float | None
    capped_by_farm: bool

    @property
    def total_tps(self) -> float:
        return self.xpu_tps + self.cpu_tps


def predict(
    xpu: XpuModel,
    w: Workload,
    layout: CpuLayout | None,
    slo_s: float | None,
    farm_tps: float | None = None,
) -> Prediction:
    """Saturated tokens/s with `layout` taking decodes (None = xPU only)."""
    cpu_tps, streams, itl = 0.0, 0, None
    if layout is not None:
        rows = layout.streams_at_slo(slo_s)
        if rows:
            cpu_tps, streams = layout.tokens_per_s(slo_s), rows * layout.workers
            itl = layout.curve.step_s(rows)
    xpu_tps = xpu.tokens_per_s(w, cpu_tps)
    capped = farm_tps is not None and xpu_tps + cpu_tps > farm_tps
    if capped:  # the farm streams no more: both shares shrink alike
        f = farm_tps / (xpu_tps + cpu_tps)
        xpu_tps, cpu_tps = xpu_tps * f, cpu_tps * f
    tail = itl * layout.curve.tail if itl is not None and layout else None
    return Prediction(layout, xpu_tps, cpu_tps, streams, itl, tail, capped)


# Totals this close to the best count as equal (a probe's noise is larger than this).
TIE = 0.02


def best(predictions: Iterable[Prediction]) -> Prediction:
    """The highest total; within TIE of it, fewer workers win (fewer processes, less memory,
    and the xPU alone over a CPU layout that adds next to nothing)."""
    preds = list(predictions)
    top = max(p.total_tps for p in preds)
    close = [p for p in preds if p.total_tps >= top * (1 - TIE)]
    return min(close, key=lambda p: (p.layout.workers if p.layout else 0, p.cpu_streams))


def _label(p: Prediction) -> str:
    return f"{p.layout.workers} x {p.layout.threads}" if p.layout else "the xPU alone"


def why_best(predictions: Iterable[Prediction], chosen: Prediction) -> str:
    """Why `best` chose `chosen`, in words: the highest total, or the rule that passed over
    the highest (a tie within TIE goes to fewer workers)."""
    preds = list(predictions)
    top = max(preds, key=lambda p: p.total_tps)
    if top.total_tps > chosen.total_tps:
        more = top.total_tps / chosen.total_tps - 1 if chosen.total_tps else float("inf")
        return (
            f"{_label(top)} has the highest total ({top.total_tps:.1f} tok/s, {more:+.1%}), "
            f"but totals within {TIE:.0%} of it count as equal (the probe's noise) and among "
            "those the fewest CPU workers win (fewer processes, less memory)"
        )
    if chosen.layout is not None:
        return "the highest total tok/s"
    cpu = [p for p in preds if p.layout is not None]
    if cpu and not any(p.cpu_streams for p in cpu):
        return "no CPU layout keeps the SLO with even one stream"
    return "no CPU layout adds tokens/s (the prefills of CPU streams cost the xPU more)"


def layouts_for(cores: int) -> list[tuple[int, int]]:
    """(workers, threads) that use `cores` evenly: 1 x cores, 2 x cores/2, ... 1 thread each."""
    out = []
    for workers in range(1, cores + 1):
        if cores % workers == 0:
            out.append((workers, cores // workers))
    return out if out else [(1, 1)]
