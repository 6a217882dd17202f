"""What structured outputs cost through the whole farm (issue 28): one farm launched as
bench/serve.py launches it (the layout `syshax run` picks), the same streamed workload free and
constrained by --response-format (json_schema: a list of people, so the grammar works at every
token), alternating per round (free first in odd rounds, constrained first in even ones, so a
drift of the machine favours neither), at each concurrency level, fresh prompts every run (no
prefix-cache hit). Prints each run's output tok/s and TPOT, the medians, the spread (min-max)
and the cost (1 - constrained / free medians).

    python bench/structured_serve.py --launch native --rounds 3 --concurrency-list 1,16 --num-prompts 16
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve  # noqa: E402 - the launcher, the prompts, the client and the summaries
import serve_launch
import serve_report

# bench/serve.py's options that mean the same here (the rest are this script's or do not apply)
SHARED = {"--client", "--api-key", "--model", "--endpoint", "--input-len", "--output-len", "--num-prompts", "--seed", "--tokenizer-model", "--launch", "--load", "--set", "--cpu-workers", "--max-batch-size", "--threads", "--launch-timeout", "--base-url"}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    for flag, kwargs in serve.OPTIONS:
        if flag in SHARED:
            p.add_argument(flag, **kwargs)
    p.add_argument("--format", choices=("json_schema", "json_object"), default="json_schema", help="the constrained runs' response_format (default %(default)s)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds: each runs both formats at every level (default %(default)s)")  # fmt: skip
    p.add_argument("--concurrency-list", type=serve._levels, default=[1, 16], metavar="C,C,...", help="concurrency levels, each run with --num-prompts requests (default 1,16)")  # fmt: skip
    args = p.parse_args(argv)
    if min(args.input_len, args.output_len, args.num_prompts, args.rounds) < 1:
        p.error("lengths, --num-prompts and --rounds must be >= 1")
    # what serve.py's functions read and this script fixes: greedy, all at once, no llama-server
    args.request_rate, args.goodput, args.against, args.direct = float("inf"), None, None, False
    args.max_concurrency, args.response_format = None, "none"
    return args


def plan(args: argparse.Namespace) -> list[tuple[int, str, int]]:
    """(round, format, level) of every run, in order."""
    runs = []
    for r in range(args.rounds):
        formats = ["none", args.format] if r % 2 == 0 else [args.format, "none"]
        runs += [(r, f, c) for c in args.concurrency_list for f in formats]
    return runs


def measure(args: argparse.Namespace, url: str) -> dict[tuple[str, int], list[dict[str, Any]]]:
    """Every run's summary, by (format, level), in round order."""
    tok = serve.load_tokenizer(args.tokenizer_model)
    runs = plan(args)
    *prompts, warm = serve.make_prompts(args, tok, args.num_prompts * len(runs) + 1)
    arrivals = [0.0] * args.num_prompts
    out: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for i, (r, fmt, c) in enumerate(runs):
        run_args = argparse.Namespace(**(vars(args) | {"max_concurrency": c, "response_format": fmt}))  # fmt: skip
        batch = prompts[i * args.num_prompts : (i + 1) * args.num_prompts]
        recs, dur = asyncio.run(serve.bench_farm(run_args, url, batch, arrivals, warm))
        s = serve_report.summarize(recs, dur, run_args)
        if s["failed"]:
            raise SystemExit(f"{s['failed']} requests failed ({fmt}, c={c}): {s['errors'][:3]}")
        out.setdefault((fmt, c), []).append(s)
        print(f"# round {r + 1} {fmt:<11} c={c:<3} {s['output_throughput']:7.1f} tok/s  TPOT p50 {s['median_tpot_ms']:6.1f} ms  ({i + 1}/{len(runs)})", file=sys.stderr)  # fmt: skip
    return out


def table(args: argparse.Namespace, out: dict[tuple[str, int], list[dict[str, Any]]]) -> str:
    fmt = args.format
    head = f"{'conc':>4}  {'free tok/s (rounds)':<24}{fmt + ' tok/s (rounds)':<30}{'free p50':>9}{'spread':>14}{fmt[:6] + ' p50':>12}{'spread':>14}{'cost':>7}{'TPOT p50 free/' + fmt[:6]:>24}"  # fmt: skip
    lines = [head]
    for c in args.concurrency_list:
        free = [s["output_throughput"] for s in out[("none", c)]]
        con = [s["output_throughput"] for s in out[(fmt, c)]]
        tpot_free = statistics.median(s["median_tpot_ms"] for s in out[("none", c)])
        tpot_con = statistics.median(s["median_tpot_ms"] for s in out[(fmt, c)])
        mf, mc = statistics.median(free), statistics.median(con)
        rounds = lambda xs: ", ".join(f"{x:.1f}" for x in xs)  # noqa: E731
        spread = lambda xs: f"{min(xs):.1f}-{max(xs):.1f}"  # noqa: E731
        lines.append(f"{c:>4}  {rounds(free):<24}{rounds(con):<30}{mf:>9.1f}{spread(free):>14}{mc:>12.1f}{spread(con):>14}{1 - mc / mf:>7.1%}{f'{tpot_free:.1f} / {tpot_con:.1f} ms':>24}")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.launch == "none":
        out = measure(args, args.base_url)
    else:
        with serve_launch.launched_farm(args) as url:
            out = measure(args, url)
    print(table(args, out))


if __name__ == "__main__":
    main()
