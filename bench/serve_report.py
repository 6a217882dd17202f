"""What `bench/serve.py` prints and saves of a run: the summary of a run's requests (vLLM's
`benchmark_serving` figures: TTFT, TPOT, ITL, E2EL, throughput, goodput), its report, the
farm's overhead against the engine in-process, the side-by-side table of a sweep, the machine."""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from serve import Rec


def summarize(recs: list[Rec], duration: float, args: argparse.Namespace) -> dict[str, Any]:
    ok = [r for r in recs if r.ok]
    series = {"ttft": [r.ttft for r in ok], "tpot": [r.tpot for r in ok if r.output_tokens > 1], "itl": [x for r in ok for x in r.itl], "e2el": [r.e2e for r in ok]}  # fmt: skip
    s: dict[str, Any] = {"completed": len(ok), "failed": len(recs) - len(ok), "duration": duration, "total_input": sum(r.prompt_len for r in ok), "total_output": sum(r.output_tokens for r in ok)}  # fmt: skip
    s["request_throughput"] = len(ok) / duration
    s["output_throughput"] = s["total_output"] / duration
    s["total_token_throughput"] = (s["total_input"] + s["total_output"]) / duration
    for name, xs in series.items():
        ms = np.asarray(xs or [0.0]) * 1000
        s |= {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)), f"p99_{name}_ms": float(np.percentile(ms, 99))}  # fmt: skip
    if args.goodput:
        slo = args.goodput
        good = sum(1 for r in ok if r.ttft * 1e3 <= slo.get("ttft", float("inf")) and r.tpot * 1e3 <= slo.get("tpot", float("inf")) and r.e2e * 1e3 <= slo.get("e2el", float("inf")))  # fmt: skip
        s |= {"goodput_requests": good, "request_goodput": good / duration, "goodput_fraction": good / len(recs)}  # fmt: skip
    s["errors"] = sorted({r.error for r in recs if not r.ok})
    return s


def report(title: str, s: dict[str, Any], args: argparse.Namespace) -> str:
    def row(k: str, v: Any) -> str:
        return f"{k:<40} {v:<10.2f}" if isinstance(v, float) else f"{k:<40} {v:<10}"

    out = [f"{' ' + title + ' ':=^50}", row("Successful requests:", s["completed"]), row("Failed requests:", s["failed"])]  # fmt: skip
    if args.max_concurrency:
        out.append(row("Maximum request concurrency:", args.max_concurrency))
    out += [row("Benchmark duration (s):", s["duration"]), row("Total input tokens:", s["total_input"]), row("Total generated tokens:", s["total_output"]), row("Request throughput (req/s):", s["request_throughput"])]  # fmt: skip
    if "request_goodput" in s:
        out += [row("Request goodput (req/s):", s["request_goodput"]), row("Goodput fraction:", s["goodput_fraction"])]  # fmt: skip
    out += [row("Output token throughput (tok/s):", s["output_throughput"]), row("Total Token throughput (tok/s):", s["total_token_throughput"])]  # fmt: skip
    for key, label, header in (("ttft", "TTFT", "Time to First Token"), ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"), ("itl", "ITL", "Inter-token Latency"), ("e2el", "E2EL", "End-to-end Latency")):  # fmt: skip
        out.append(f"{header:-^50}")
        out += [row(f"{stat.capitalize() if stat != 'p99' else 'P99'} {label} (ms):", s[f"{stat}_{key}_ms"]) for stat in ("mean", "median", "p99")]  # fmt: skip
    out += [f"error: {e}" for e in s["errors"][:5]] + ["=" * 50]
    return "\n".join(out)


def overhead(farm: dict[str, Any], direct: dict[str, Any]) -> tuple[str, dict[str, float]]:
    keys = ("itl", "tpot", "ttft", "e2el")
    diff = {f"median_{k}_ms": farm[f"median_{k}_ms"] - direct[f"median_{k}_ms"] for k in keys}
    out = [f"{' Farm overhead (farm - direct) ':=^50}", f"{'':<22}{'farm':>9}{'direct':>9}{'diff':>10}"]  # fmt: skip
    for k in keys:
        out.append(f"{'Median ' + k.upper() + ' (ms):':<22}{farm[f'median_{k}_ms']:>9.2f}{direct[f'median_{k}_ms']:>9.2f}{diff[f'median_{k}_ms']:>+10.2f}")  # fmt: skip
    out += [f"{'Farm overhead per token (median ITL) (ms):':<44}{diff['median_itl_ms']:>+6.2f}", f"{'Farm overhead per token (median TPOT) (ms):':<44}{diff['median_tpot_ms']:>+6.2f}", "=" * 50]  # fmt: skip
    return "\n".join(out), diff


def comparison(sums: dict[str, dict[int, dict[str, Any]]], args: argparse.Namespace) -> tuple[str, list[dict[str, Any]]]:  # fmt: skip
    """The side-by-side table (and its rows): per level and server, output tok/s, TTFT and ITL
    p50/p99; farm/llama-server for tok/s on the llama-server row."""
    rows, notes = [], []
    head = f"{'conc':>5}  {'server':<13}{'requests':>9}{'out tok/s':>11}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}{'farm/llama':>12}"  # fmt: skip
    out = [f"{' Serving comparison (TTFT, ITL in ms) ':=^{len(head)}}", head]
    for c in args.concurrency_list:
        for server, by_level in sums.items():
            s = by_level[c]
            row = {"concurrency": c, "server": server, "completed": s["completed"], "requests": s["completed"] + s["failed"], "output_throughput": s["output_throughput"], "median_ttft_ms": s["median_ttft_ms"], "p99_ttft_ms": s["p99_ttft_ms"], "median_itl_ms": s["median_itl_ms"], "p99_itl_ms": s["p99_itl_ms"]}  # fmt: skip
            ratio = ""
            if server == "llama-server" and s["output_throughput"] > 0:
                row["farm_over_llama_tok_s"] = sums["farm"][c]["output_throughput"] / s["output_throughput"]  # fmt: skip
                ratio = f"{row['farm_over_llama_tok_s']:.2f}x"
            rows.append(row)
            out.append(f"{c:>5}  {server:<13}{str(row['completed']) + '/' + str(row['requests']):>9}{s['output_throughput']:>11.1f}{s['median_ttft_ms']:>10.1f}{s['p99_ttft_ms']:>10.1f}{s['median_itl_ms']:>9.1f}{s['p99_itl_ms']:>9.1f}{ratio:>12}")  # fmt: skip
            if s["completed"] and s["total_output"] != s["completed"] * args.output_len:
                notes.append(f"note: {server} at {c} generated {s['total_output']} tokens, not {s['completed']} x {args.output_len}")  # fmt: skip
            notes += [f"error: {server} at {c}: {e}" for e in s["errors"][:3]]
    if "llama-server" in sums:  # the two tokenizers may count the same text differently
        c = args.concurrency_list[0]
        ins = {n: by[c]["total_input"] / max(by[c]["completed"], 1) for n, by in sums.items()}
        if len(set(ins.values())) > 1:
            notes.append("note: prompt tokens per request (server usage): " + ", ".join(f"{n} {v:.1f}" for n, v in ins.items()))  # fmt: skip
    return "\n".join(out + notes + ["=" * len(head)]), rows


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("model name")), cpu)  # fmt: skip
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()}  # fmt: skip
