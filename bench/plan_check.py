"""`syshax plan` against a bench/hetero.py run: predicted vs measured, with the error.

    python bench/plan_check.py bench/results/hetero.json [--plan plan.json]

Runs `syshax plan --json` with the run's settings (profile, model, xPU slots, SLO, CPU layout
and slots, workload; its CPU probe on this machine) unless --plan gives that output, then
compares three figures with the run: the xPU alone (best `xpu` steady tok/s), the CPU's
capacity at the SLO (its standalone run), and `auto` at the top level. Three times: as
predicted (the xPU worker's own per-step cost unknown: 0; the CPU step from the probe); with
the xPU's cost as the run measured it below saturation (xPU streams' ITL p50 minus the
profile's step at that level: the xPU-alone figure then reuses the run's own timing); and with
the CPU's step taken from the run too (its standalone levels' ITL p50, fitted, and their worst
p99 / p50 as the tail). The last one feeds the plan's arithmetic the run's own inputs, so what
error is left in `auto` is the model's, not the probe's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


def plan_json(run: dict, extra: list[str]) -> dict:
    c = run["config"]
    from syshax.shared.config import resolve_threads

    threads = resolve_threads(c["cpu_threads"])  # what the run's CPU workers got
    cmd = [sys.executable, "-m", "syshax.cli", "plan", "--json", "--profile", c["profile"], "--xpu-slots", str(c["xpu_slots"]), "--slo-itl-ms", str(c["slo_itl_ms"]), "--layouts", f"{c['cpu_workers'] or 1}x{threads}", "--cpu-max-batch", str(c["cpu_slots"]), "--input-len", str(c["input_len"]), "--output-len", str(c["output_len"])]  # fmt: skip
    if c.get("load"):
        cmd += ["--model", c["load"]]
    out = subprocess.run(cmd + extra, check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def measured_overhead(run: dict) -> tuple[float, float]:
    """(base, per_row) ms of the xPU worker's own per-step cost, from the `xpu` levels at or
    below its slots: ITL p50 of its streams minus the profile's predicted step there."""
    from syshax.workers.accelerator_profiles import load_profile, model_scale
    from syshax.workers.capacity_plan import StepCurve, Workload, XpuModel
    from syshax.workers.engine.loader import resolve_model_path

    c = run["config"]
    prof = load_profile(c["profile"])
    scale = model_scale(resolve_model_path(c.get("load") or "default"), prof)
    w = Workload(c["input_len"], c["output_len"])
    points = []
    for level, s in run["results"]["xpu"].items():
        if int(level) <= c["xpu_slots"]:
            step = XpuModel(prof, scale, int(level)).decode_step_s(w) * 1e3
            points.append((int(level), s["devices"]["xpu"]["median_itl_ms"] - step))
    if not points:
        return 0.0, 0.0
    fit = StepCurve.fit(points)
    return fit.base_s, fit.per_row_s


def measured_cpu_step(run: dict) -> str | None:
    """`--cpu-step-ms BASE,PER_ROW,TAIL` from the run's standalone CPU levels: their streams'
    ITL p50 fitted over the level, and the worst ITL p99 / p50 as the tail."""
    from syshax.workers.capacity_plan import StepCurve

    points, tails = [], []
    for level, s in run["results"].get("cpu", {}).items():
        d = s["devices"]["cpu"]
        if d["median_itl_ms"] > 0:
            points.append((int(level), d["median_itl_ms"]))
            tails.append(d["p99_itl_ms"] / d["median_itl_ms"])
    if not points:
        return None
    fit = StepCurve.fit(points, tail=max(tails))
    return f"{fit.base_s:.3f},{fit.per_row_s:.3f},{fit.tail:.2f}"


def measured(run: dict) -> dict[str, float]:
    r = run["results"]
    top = str(max(int(c) for c in r["auto"]))
    return {
        "xPU alone": max(s["steady_throughput"] for s in r["xpu"].values()),
        "CPU at the SLO": (run["cpu_capacity"] or {}).get("steady_throughput", 0.0),
        f"auto at {top} streams": r["auto"][top]["steady_throughput"],
    }


def predicted(plan: dict) -> list[float]:
    (row,) = plan["with_cpu"]
    return [plan["xpu_alone"]["total_tok_s"], row["cpu_tok_s"], row["total_tok_s"]]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path, help="a bench/hetero.py --json file")
    p.add_argument("--plan", type=Path, help="`syshax plan --json` output to use instead of running it (as predicted; the calibrated variant is then skipped)")  # fmt: skip
    args = p.parse_args(argv)
    run = json.loads(args.run.read_text())
    meas = measured(run)
    variants = {"predicted (overhead 0)": json.loads(args.plan.read_text()) if args.plan else plan_json(run, [])}  # fmt: skip
    if not args.plan:
        base, per_row = measured_overhead(run)
        name = f"with the run's xPU overhead ({base:.2f} + {per_row:.3f} x streams ms)"
        variants[name] = plan_json(run, ["--xpu-overhead-ms", f"{base},{per_row}"])
        if step := measured_cpu_step(run):
            name = f"and the run's CPU step ({step.replace(',', ' / ')} ms, tail)"
            variants[name] = plan_json(run, ["--xpu-overhead-ms", f"{base},{per_row}", "--cpu-step-ms", step])  # fmt: skip
    print(f"run: {args.run} ({run['date']}; {run['command']})")
    print("\n| figure | measured tok/s | " + " | ".join(variants) + " |")
    print("|---|---:|" + "---:|" * len(variants))
    for i, (name, value) in enumerate(meas.items()):
        cells = []
        for plan in variants.values():
            pred = predicted(plan)[i]
            cells.append(f"{pred:.1f} ({pred / value - 1:+.0%})" if value else f"{pred:.1f}")
        print(f"| {name} | {value:.1f} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
