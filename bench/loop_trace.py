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
    # The compute threads' CPU between two steps (spinning while the loop talks to Redis).
    rows["side-cpu-outside"] = [r["kout"] for r in stepped if "kout" in r]
    rows["others-cpu-in-step"] = [r["oth"] for r in stepped if "oth" in r]
    for n, xs in rows.items():
        if xs:
            print(f"{n:<22}{len(xs):>6} {pct(xs)}")
    if rows["side-cpu-outside"]:
        side, outside = sum(rows["side-cpu-outside"]), sum(rows["loop-not-execute"])
        print(f"# side threads' CPU outside the steps: {side * 1e3:.1f} ms in all, {side / len(rows['side-cpu-outside']) * 1e3:.3f} ms a step, {side / outside:.1%} of the loop's time outside them")  # fmt: skip
    tokens = sum(len(r.get("out", [])) for r in recs)
    rts = sum(r.get("rt", 0) for r in recs)
    by_phase: dict[str, int] = defaultdict(int)
    for r in recs:
        for k, v in r.get("rtp", {}).items():
            by_phase[k] += v
    print("# round trips by phase: " + ", ".join(f"{k} {v}" for k, v in sorted(by_phase.items())))
    # Between two steps: every round trip but the step's own publish and those sent while the
    # step ran (under the step's phases, or "side": the job poll sent with the step).
    during = ("publish", "execute", "side")
    between = [
        sum(v for k, v in r.get("rtp", {}).items() if k not in during and not k.startswith("e-"))
        for r in stepped
    ]
    if between:
        print(f"# round trips between steps: {sum(between) / len(between):.2f} a step; steps with none: {sum(b == 0 for b in between) / len(between):.1%}")  # fmt: skip
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


def deliveries(recs: list[dict], path: Path) -> list[dict]:
    """Each client token lined up with the worker's publish of it (serve.py keeps each
    request's perf_counter() start, the CLOCK_MONOTONIC of the trace's `t` and `pt`): per
    gap (token i-1 -> i of a request) the client's gap, the worker's (publish end to publish
    end), the step's model time and the record of the iteration that published token i."""
    published: dict[tuple[str, int], tuple[float, dict]] = {}
    for r in recs:
        for rid, idx in r.get("out", []):
            published[(rid, idx)] = (r.get("pt", r["t"] + r["dt"]), r)
    rids = {rid for rid, _ in published}
    doc = json.loads(path.read_text())
    gaps = []
    for res in doc["results"].values():
        runs = res.values() if "requests" not in res else [res]
        for run in runs:
            for req in run["requests"]:
                rid, itl = req.get("request_id", ""), req.get("itl", [])
                if rid not in rids or "t_start" not in req or req["chunks"] != req["output_tokens"]:
                    continue  # another server's request, or chunks of several tokens
                c = req["t_start"] + req["ttft"]
                for i, g in enumerate(itl, start=1):
                    c += g
                    if (rid, i) in published and (rid, i - 1) in published:
                        (p1, rec), (p0, _) = published[(rid, i)], published[(rid, i - 1)]
                        model = rec.get("ph", {}).get("execute", 0.0)
                        gaps.append({"req": rid, "i": i, "client": g, "worker": p1 - p0, "lag": c - p1, "model": model, "rec": rec})  # fmt: skip
    return gaps


def slow_gaps(gaps: list[dict], factor: float = 1.5) -> None:
    """The client's slow gaps (over `factor` x its median), each split into what the worker's
    gap added (a late or slow step) and what the delivery added (Redis -> gateway -> client)."""
    if not gaps:
        print("# no client gap lines up with the trace (run serve.py with --client raw)")
        return
    cl = np.array([g["client"] for g in gaps])
    wk = np.array([g["worker"] for g in gaps])
    md = np.array([g["model"] for g in gaps])
    lag = np.array([g["lag"] for g in gaps])
    med_c, med_w, med_m = np.median(cl), np.median(wk), np.median(md)
    reqs = len({g["req"] for g in gaps})
    slow = [g for g in gaps if g["client"] > factor * med_c]
    print(f"# delivery lag (client receipt - publish end) ms: {pct(list(lag))} (p50 p90 p99 max)")
    print(f"# {len(gaps)} gaps of {reqs} requests lined up; medians client {med_c * 1e3:.2f}, worker {med_w * 1e3:.2f}, model step {med_m * 1e3:.2f} ms")  # fmt: skip
    print(f"# client gaps > {factor}x median: {len(slow)} ({len(slow) / reqs:.2f} per request); worker gaps > {factor}x median: {int((wk > factor * med_w).sum())}; model steps > {factor}x median: {int((md > factor * med_m).sum())}")  # fmt: skip
    out_c = np.array([g["worker"] - g["model"] for g in gaps])
    print(f"# worker gap outside the model step ms: {pct(list(out_c))}")
    kinds: dict[str, int] = defaultdict(int)
    for g in slow:
        extra = g["client"] - med_c
        w_extra, m_extra = g["worker"] - med_w, g["model"] - med_m
        if w_extra < extra / 2:
            kinds["delivery (lag grew)"] += 1
        elif m_extra >= w_extra / 2:
            kinds["model step slow"] += 1
        else:
            kinds["worker outside the step"] += 1
    print("# slow client gaps by what added most: " + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())))  # fmt: skip
    print(f"{'req':>10} {'i':>3} {'client':>7} {'worker':>7} {'model':>7} {'lag':>6}  phases of the publishing iteration (ms), rt")  # fmt: skip
    for g in sorted(slow, key=lambda g: -g["client"])[:20]:
        ph = " ".join(f"{k}={v * 1e3:.1f}" for k, v in g["rec"].get("ph", {}).items() if v > 5e-4)
        print(f"{g['req'][-10:]:>10} {g['i']:>3} {g['client'] * 1e3:7.1f} {g['worker'] * 1e3:7.1f} {g['model'] * 1e3:7.1f} {g['lag'] * 1e3:6.1f}  {ph} rt={g['rec'].get('rt', 0)}")  # fmt: skip


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
        slow_gaps(deliveries(recs, args.serve_json))


if __name__ == "__main__":
    main()
