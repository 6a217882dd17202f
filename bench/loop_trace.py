"""Summarise the worker loop's trace (workers/loop_trace.py) and a serve run's inter-token gaps by
token position: where a stream's tail comes from.

    SYSHAX_LOOP_TRACE=/tmp/lt python bench/serve.py --launch native --load M.gguf \\
        --num-prompts 16 --max-concurrency 1 --json /tmp/run.json
    python bench/loop_trace.py /tmp/lt --serve-json /tmp/run.json

Printed: per phase of the iterations that published tokens, its p50 / p90 / p99 / max (ms) and
how many iterations ran it; Redis round trips per token; the collector's pauses; the
worker-side gap between a request's consecutive token events by position (gap 1 = the first
token -> the second), and the same gaps as the client saw them (serve.py's `itl` lists).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import numpy as np


def pct(xs: list[float]) -> str:
    if not xs:
        return "-"
    a = np.asarray(xs) * 1e3
    return f"{np.percentile(a, 50):7.2f} {np.percentile(a, 90):7.2f} {np.percentile(a, 99):7.2f} {a.max():7.2f}"  # fmt: skip


def load(folder: Path) -> list[dict]:
    recs = []
    for f in sorted(folder.glob("loop-*.jsonl")):
        recs += [json.loads(line) for line in f.read_text().splitlines() if line]
    return recs


def phases(recs: list[dict]) -> None:
    stepped = [r for r in recs if "execute" in r.get("ph", {})]
    print(f"# {len(recs)} iterations traced, {len(stepped)} with an engine step")
    names = sorted({k for r in stepped for k in r["ph"]})
    print(f"{'phase (ms)':<22}{'n':>6}     p50     p90     p99     max")
    rows = {n: [r["ph"][n] for r in stepped if n in r["ph"]] for n in names}
    # `update` includes `publish` and `place`: its own part is shown as update-own.
    rows["update-own"] = [
        r["ph"].get("update", 0) - r["ph"].get("publish", 0) - r["ph"].get("place", 0)
        for r in stepped
    ]
    rows["loop-not-execute"] = [r["dt"] - r["ph"]["execute"] for r in stepped]
    rows["iteration"] = [r["dt"] for r in stepped]
    rows["cpu"] = [r["cpu"] for r in stepped]
    for n, xs in rows.items():
        print(f"{n:<22}{len(xs):>6} {pct(xs)}")
    tokens = sum(len(r.get("out", [])) for r in recs)
    rts = sum(r.get("rt", 0) for r in recs)
    by_phase: dict[str, int] = defaultdict(int)
    for r in recs:
        for k, v in r.get("rtp", {}).items():
            by_phase[k] += v
    print("# round trips by phase: " + ", ".join(f"{k} {v}" for k, v in sorted(by_phase.items())))
    gcs = [r for r in recs if r.get("gc")]
    print(f"# Redis round trips: {rts} for {tokens} tokens ({rts / max(tokens, 1):.2f} per token)")
    gens = defaultdict(int)
    for r in gcs:
        for g in r.get("gcg", []):
            gens[g] += 1
    print(f"# GC: {sum(gens.values())} collections by generation {dict(gens)}; pause ms {pct([r['gc'] for r in gcs])}")  # fmt: skip


def worker_gaps(recs: list[dict]) -> dict[int, list[float]]:
    """Gap between a request's consecutive token events (iteration end times) by position."""
    last: dict[str, float] = {}
    by_pos: dict[int, list[float]] = defaultdict(list)
    for r in recs:
        end = r.get("pt", r["t"] + r["dt"])  # when the step's publish ended
        for rid, idx in r.get("out", []):
            if rid in last:
                by_pos[idx].append(end - last[rid])
            last[rid] = end
    return by_pos


def client_gaps(path: Path) -> dict[int, list[float]]:
    doc = json.loads(path.read_text())
    by_pos: dict[int, list[float]] = defaultdict(list)
    for res in doc["results"].values():
        runs = res.values() if "requests" not in res else [res]
        for run in runs:
            for req in run["requests"]:
                for i, g in enumerate(req.get("itl", []), start=1):
                    by_pos[i].append(g)
    return by_pos


def by_position(title: str, by_pos: dict[int, list[float]]) -> None:
    allg = [g for xs in by_pos.values() for g in xs]
    if not allg:
        return
    p99 = float(np.percentile(allg, 99))
    print(f"# {title}: {len(allg)} gaps, p50 {np.percentile(allg, 50) * 1e3:.2f} ms, p99 {p99 * 1e3:.2f} ms")  # fmt: skip
    print(f"{'gap #':<8}{'n':>5}     p50     p90     p99     max  >=p99")
    for pos in sorted(by_pos):
        xs = by_pos[pos]
        over = sum(g >= p99 for g in xs)
        if pos <= 3 or pos >= max(by_pos) - 1 or over:
            print(f"{pos:<8}{len(xs):>5} {pct(xs)} {over:>6}")
    without_first = [g for p, xs in by_pos.items() if p != 1 for g in xs]
    print(f"# without gap 1: p50 {np.percentile(without_first, 50) * 1e3:.2f} ms, p99 {np.percentile(without_first, 99) * 1e3:.2f} ms")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("folder", type=Path, help="the SYSHAX_LOOP_TRACE folder")
    p.add_argument("--serve-json", type=Path, help="a bench/serve.py --json file of the same run")
    args = p.parse_args()
    recs = load(args.folder)
    phases(recs)
    by_position("worker-side gaps (publish ends)", worker_gaps(recs))
    if args.serve_json:
        by_position("client-side ITL", client_gaps(args.serve_json))


if __name__ == "__main__":
    main()
