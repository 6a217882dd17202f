"""The farm with an EMULATED xPU and real CPU decode workers: `decode_device: xpu` against
`auto` (with `slo.itl_ms`) at several closed-loop load levels, and the CPU's standalone
capacity at the SLO (issue 14).

    python bench/hetero.py --levels 1,4,8,16,32 --slo-itl-ms 50 --json hetero.json

The xPU is EMULATED (`xpu.engine: emulated`, docs/emulated-accelerator.md): its steps are
sleeps of the time `--profile` predicts for the farm's model, its text is meaningless, and it
uses no CPU; the CPU decode workers run the real model (on the zeroed KV it hands off).

Design:
- Closed loop (bench/serve.py's client, the light one by default: `--client raw`, aiohttp with
  the SSE parsed by hand, since on a small host it shares the cores with the farm it measures;
  `--max-concurrency` per level): the level *is* the
  number of streams in flight, so "saturated" has a plain meaning: more streams than the xPU
  has slots (`--xpu-slots`, xpu.max_batch_size). A fresh farm per mode (no state or prefix
  cache carried over), the same prompts at a level in every mode, fresh prompts per level.
- The xPU's slots are few on purpose (default 4) and the profile is the slowest (a10): at
  the 135M default model an emulated step takes well under 1 ms, so with the default 16 slots
  the xPU would never saturate before the gateway and the client (which share the cores with
  the CPU workers) do; with few slots the xPU is the bottleneck at the higher levels and
  `auto` has streams to send to the CPU. The header prints the predicted xPU step at its
  slots.
- Which device decoded each stream: every token event the workers write to the request's
  output stream (`syshax:out:{id}`, the authoritative copy, kept `output.ttl`) carries the
  worker's `device` (`emulated:NAME` or `cpu`), and the SSE chunks' `id` is that request id.
  After each level the bench reads those streams from the farm's Redis (the bench started
  it): exact, per token, and nothing added to the farm. A stream's device is the one that
  produced its tokens after the first (the first always comes from the xPU's prefill);
  per-device tok/s counts every token by the device that produced it. Dispatcher decisions
  by rule come from the xPU worker's `syshax:dispatcher_decisions_total{device,rule}`,
  scraped before and after each level (so they include the level's warm-up request); the
  JSON keeps the last 100 lines of the dispatch log (their reasons, with the predictions).
- CPU capacity: a farm with `decode_device: cpu` (the xPU only prefills) at levels 1, 2, 4, ...
  up to the CPU workers' slots; the capacity is the largest level whose ITL (`--capacity-stat`,
  p99 by default: the same bar as the done-when's) stays within the SLO, and its tok/s.
- Throughput: "out tok/s" is serve.py's (every token / the whole run, ramp-down tail
  included: a closed loop ends with the slowest streams, the CPU's); "steady tok/s" counts the
  tokens delivered between the first request sent and the last one sent, while every client
  had a stream in flight: the capacity figure the done-when compares.
- Done-when (issue 14): at the top level (saturated when it is at least the xPU's slots plus
  the CPU's streams at capacity), `auto` steady tok/s >= 90% of (best `xpu` steady tok/s + CPU
  capacity) and every device's ITL p99 <= the SLO; at levels within the xPU's slots `auto`'s
  TTFT p50 and ITL p50 <= `xpu`'s x (1 + --tolerance) + --tolerance-ms.
- ITL is the gap between content chunks as the client sees them (one token each), so it
  includes the gateway and the client; a CPU stream's first gap is the KV handoff (export,
  queue, import), which "1st gap" shows apart: with short outputs that one gap alone can
  set a stream's p99.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import shlex
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import serve  # noqa: E402
import serve_launch
import serve_report

XPU, CPU = "xpu", "cpu"


def device_class(device: str) -> str:
    """A token event's `device` as a class: the CPU workers' is `cpu`, the xPU's `emulated:NAME`."""
    return CPU if device == CPU else XPU


def stream_device(by_seq: dict[int, str]) -> str:
    """The class that decoded a stream (tokens after the first), `mixed` if both did (a request
    resumed on another worker), the first token's for a one-token stream."""
    decode = {device_class(d) for s, d in by_seq.items() if s >= 1}
    if not decode:
        return device_class(by_seq[0]) if 0 in by_seq else "?"
    return decode.pop() if len(decode) == 1 else "mixed"


def pct(xs: list[float], q: float) -> float:
    """Percentile in ms of seconds `xs` (0 when empty, as serve_report.summarize)."""
    return float(np.percentile(np.asarray(xs or [0.0]) * 1e3, q))


def window(recs: list[serve.Rec]) -> tuple[float, float]:
    """The steady part of a closed-loop run: from the first request sent to the last one sent
    (every client has a stream in flight all along), without the ramp-down tail."""
    starts = [r.t_start for r in recs if r.t_start]
    return (min(starts), max(starts)) if starts else (0.0, 0.0)


def chunk_times(r: serve.Rec) -> list[float]:
    """perf_counter() of each content chunk of a stream (one token each, but empty-text ones)."""
    if not r.chunks:
        return []
    return (r.t_start + r.ttft + np.concatenate([[0.0], np.cumsum(r.itl)])).tolist()


def steady_tok_s(recs: list[serve.Rec], device: dict[str, str] | None = None) -> dict[str, float]:
    """Tokens/s delivered within `window` (a chunk counts as a token), by the class that made
    each: a stream's first token its prefill's (the xPU), the rest its decode device's.
    "total" sums them; 0 when the window is under 10 ms (too few requests per stream)."""
    t0, t1 = window(recs)
    out: Counter[str] = Counter()
    for r in (r for r in recs if r.ok):
        dev = (device or {}).get(r.request_id, XPU)
        for i, t in enumerate(chunk_times(r)):
            if t0 <= t <= t1:
                out[XPU if i == 0 else dev] += 1
    span = t1 - t0
    out["total"] = sum(out.values())
    return {k: v / span if span >= 0.01 else 0.0 for k, v in out.items()}


def per_device(recs: list[serve.Rec], events: dict[str, dict[int, str]], duration: float) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Per device class: streams, their share, tokens produced (every token, by its device),
    tok/s over the run and steady (`steady_tok_s`), TTFT p50, the handoff gap (first token to
    second: KV export, queue, import) p50 and ITL p50/p99 of the streams it decoded."""
    out: dict[str, dict[str, Any]] = {}
    ok = [r for r in recs if r.ok]
    dev_of = {r.request_id: stream_device(events.get(r.request_id, {})) for r in ok}
    steady = steady_tok_s(recs, dev_of)
    tokens: Counter[str] = Counter()
    for r in ok:
        tokens.update(device_class(d) for d in events.get(r.request_id, {}).values())
    for dev in (XPU, CPU, "mixed", "?"):
        mine = [r for r in ok if dev_of[r.request_id] == dev]
        if not mine and not tokens[dev]:
            continue
        itl = [x for r in mine for x in r.itl]
        out[dev] = {"streams": len(mine), "stream_share": len(mine) / max(len(ok), 1), "tokens": tokens[dev], "tok_s": tokens[dev] / duration, "steady_tok_s": steady.get(dev, 0.0), "median_ttft_ms": pct([r.ttft for r in mine], 50), "median_gap1_ms": pct([r.itl[0] for r in mine if r.itl], 50), "median_itl_ms": pct(itl, 50), "p99_itl_ms": pct(itl, 99)}  # fmt: skip
    return out


def capacity_at_slo(rows: list[dict[str, Any]], slo_ms: float, stat: str = "p99") -> dict[str, Any] | None:  # fmt: skip
    """The largest level whose CPU streams keep ITL `stat` within the SLO (None: none does)."""
    good = [r for r in rows if r["completed"] and r[f"{'median' if stat == 'p50' else 'p99'}_itl_ms"] <= slo_ms]  # fmt: skip
    return max(good, key=lambda r: r["concurrency"]) if good else None


def read_events(redis_url: str, recs: list[serve.Rec]) -> dict[str, dict[int, str]]:
    """request id -> {seq: device} from each request's output stream."""
    import redis
    from syshax.broker.keys import KEYS
    from syshax.broker.schemas import entry_events

    r, out = redis.Redis.from_url(redis_url), {}
    for rec in recs:
        if not rec.request_id:
            continue
        seqs: dict[int, str] = {}
        for _id, fields in r.xrange(KEYS.output_stream(rec.request_id)):
            for ev in entry_events(fields):  # a record's entry holds every event since the last
                if ev.token_id >= 0:
                    seqs.setdefault(ev.seq, ev.device)
        out[rec.request_id] = seqs
    r.close()
    return out


def dispatch_log(redis_url: str) -> list[str]:
    import redis
    from syshax.broker.keys import KEYS

    with redis.Redis.from_url(redis_url, decode_responses=True) as r:
        return r.lrange(KEYS.dispatch_log, 0, 99)


def decisions(metrics_url: str) -> Counter[str]:
    """The xPU worker's dispatcher decisions so far, as {'device/rule': count}."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(metrics_url, timeout=5.0).text
    except httpx.HTTPError:
        return Counter()
    return Counter({f"{s.labels['device']}/{s.labels['rule']}": int(s.value) for f in text_string_to_metric_families(text) for s in f.samples if s.name.endswith("dispatcher_decisions_total")})  # fmt: skip


def farm_args(args: argparse.Namespace, mode: str) -> argparse.Namespace:
    """serve.py's options for a launched farm of this mode: the emulated xPU, the SLO, the
    slots, free metrics ports (the xPU's is scraped), all else the defaults."""
    from syshax.broker.embedded import free_port

    xpu_port, cpu_port = free_port(), free_port()
    settings: dict[str, Any] = {"decode_device": mode, "cpu_max_batch_size": args.cpu_slots, "xpu": {"engine": "emulated", "profile": args.profile, "max_batch_size": args.xpu_slots, "port": xpu_port}, "cpu": {"port": cpu_port, "threads": args.cpu_threads, **({} if args.cpu_nice is None else {"nice": args.cpu_nice}), **({} if args.cpu_sched_idle is None else {"sched_idle": args.cpu_sched_idle})}, "slo": {"itl_ms": args.slo_itl_ms}}  # fmt: skip
    ns = argparse.Namespace(**vars(args))
    ns.__dict__.update(launch="emulated", farm_settings=settings, max_batch_size=None, threads=None, against=None, model=None, api_key="unused", goodput=None, max_concurrency=None, metrics_url=f"http://127.0.0.1:{xpu_port}/metrics")  # fmt: skip
    return ns


def run_mode(args: argparse.Namespace, mode: str, levels: list[int], prompts: list[serve.Prompt], warm: serve.Prompt) -> dict[int, dict[str, Any]]:  # fmt: skip
    """Launch a farm with `decode_device: mode`, run every level, stop it."""
    ns, info, out, start = farm_args(args, mode), {}, {}, 0
    with serve_launch.launched_farm(ns, info) as url:
        wait_workers(url, args.cpu_workers or 1, args.launch_timeout)
        for c in levels:
            n = requests_at(args, c)
            batch, start = prompts[start : start + n], start + n
            before = decisions(ns.metrics_url)
            recs, dur = asyncio.run(serve.bench_farm(serve.at_level(ns, c), url, batch, [0.0] * n, warm))  # fmt: skip
            dec = decisions(ns.metrics_url) - before
            s = serve_report.summarize(recs, dur, ns)
            s |= {"mode": mode, "concurrency": c, "decisions": dict(dec), "devices": per_device(recs, read_events(info["redis_url"], recs), dur), "steady_throughput": steady_tok_s(recs)["total"]}  # fmt: skip
            s["dispatch_log"] = dispatch_log(info["redis_url"])
            s["requests"] = [{k: v for k, v in vars(r).items() if k not in ("t_start", "t_last")} for r in recs]  # fmt: skip
            out[c] = s
            print(f"# {mode} at {c}: {s['completed']}/{len(recs)} ok, {s['output_throughput']:.1f} tok/s ({s['steady_throughput']:.1f} steady), CPU streams {s['devices'].get(CPU, {}).get('streams', 0)}", file=sys.stderr)  # fmt: skip
    return out


def wait_workers(url: str, n_cpu: int, timeout: float) -> None:
    """Until the gateway's /health counts the xPU and every CPU decode worker: it answers 200
    as soon as any decoder is alive, and a decode dispatched before the CPU worker's first
    heartbeat goes to the xPU (rule no_cpu_decoder)."""
    import time

    import httpx

    root, deadline = url.removesuffix("/v1"), time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, TypeError):
            dec = httpx.get(f"{root}/health", timeout=2.0).json()["workers"]["decode"]
            if dec.get("xpu", 0) >= 1 and dec.get("cpu", 0) >= n_cpu:
                return
        time.sleep(0.25)
    raise SystemExit(f"the farm at {root} did not report 1 xPU and {n_cpu} CPU decode worker(s) within {timeout:.0f}s")  # fmt: skip


def requests_at(args: argparse.Namespace, c: int) -> int:
    return max(args.num_prompts, args.rounds * c)


def xpu_step_ms(args: argparse.Namespace, slots: int) -> float | None:
    """The profile's predicted decode step at `slots` streams of mean context, for the model."""
    from syshax.workers.accelerator_profiles import load_profile, model_scale

    try:
        prof = load_profile(args.profile)
        scale = model_scale(serve_launch.farm_config(farm_args(args, "xpu")).model_path(), prof)
    except Exception:  # only for the header
        return None
    ctx = slots * (args.input_len + args.output_len // 2)
    return prof.step_seconds(0, slots, ctx, scale) * 1e3


def verdict(args: argparse.Namespace, res: dict[str, dict[int, dict[str, Any]]], cap: dict[str, Any] | None) -> list[str]:  # fmt: skip
    """The issue's done-when, checked on this run's numbers."""
    out, slo, top = [], args.slo_itl_ms, max(args.levels)
    xpu_best = max(s["steady_throughput"] for s in res["xpu"].values())
    cap_tps, cap_c = (cap["steady_throughput"], cap["concurrency"]) if cap else (0.0, 0)
    sat = top >= args.xpu_slots + cap_c
    auto = res["auto"][top]["steady_throughput"]
    target = 0.9 * (xpu_best + cap_tps)
    out.append(f"- saturation (level {top}, steady tok/s{'' if sat else ', NOT saturated: below xPU slots + CPU streams at capacity'}): auto {auto:.1f} tok/s vs 90% of (xpu-only best {xpu_best:.1f} + CPU capacity {cap_tps:.1f}) = {target:.1f}: **{'PASS' if auto >= target else 'FAIL'}** ({auto / max(xpu_best + cap_tps, 1e-9):.0%})")  # fmt: skip
    bad = [f"{c}/{d} {v['p99_itl_ms']:.1f} ms" for c, s in res["auto"].items() for d, v in s["devices"].items() if v["streams"] and v["p99_itl_ms"] > slo]  # fmt: skip
    out.append(f"- auto: ITL p99 of every device's streams <= {slo:g} ms at every level: **{'PASS' if not bad else 'FAIL'}**" + (f" (over: {', '.join(bad)})" if bad else ""))  # fmt: skip
    tol, worse = 1 + args.tolerance, []
    for c in (c for c in args.levels if c <= args.xpu_slots):
        a, x = res["auto"][c], res["xpu"][c]
        worse += [f"{c}: {k} {a[f'median_{k}_ms']:.1f} vs {x[f'median_{k}_ms']:.1f} ms" for k in ("ttft", "itl") if a[f"median_{k}_ms"] > x[f"median_{k}_ms"] * tol + args.tolerance_ms]  # fmt: skip
    out.append(f"- below saturation (levels <= {args.xpu_slots} xPU slots): auto TTFT p50 and ITL p50 <= xpu's x {tol:g} + {args.tolerance_ms:g} ms: **{'PASS' if not worse else 'FAIL'}**" + (f" (worse: {'; '.join(worse)})" if worse else ""))  # fmt: skip
    return out


def tables(args: argparse.Namespace, res: dict[str, dict[int, dict[str, Any]]], cap: dict[str, Any] | None, head: list[str]) -> str:  # fmt: skip
    out = head + ["", f"## CPU standalone capacity (decode_device: cpu, the EMULATED xPU only prefills; SLO {args.slo_itl_ms:g} ms on ITL {args.capacity_stat})", "", "| streams | requests | out tok/s | steady tok/s | TTFT p50 | ITL p50 | ITL p99 | within SLO |", "|---:|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    stat = "median_itl_ms" if args.capacity_stat == "p50" else "p99_itl_ms"
    for c, s in res["cpu"].items():
        out.append(f"| {c} | {s['completed']}/{s['completed'] + s['failed']} | {s['output_throughput']:.1f} | {s['steady_throughput']:.1f} | {s['median_ttft_ms']:.1f} | {s['median_itl_ms']:.1f} | {s['p99_itl_ms']:.1f} | {'yes' if s[stat] <= args.slo_itl_ms else 'no'} |")  # fmt: skip
    out += ["", f"CPU capacity at the SLO: {cap['steady_throughput']:.1f} steady tok/s at {cap['concurrency']} streams." if cap else "CPU capacity at the SLO: none (no level kept the SLO)."]  # fmt: skip
    out += ["", "## xpu vs auto (totals; ms; steady tok/s: while every client had a stream in flight, without the ramp-down tail)", "", "| streams | decode_device | requests | out tok/s | steady tok/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | CPU streams | CPU tokens | decisions (device/rule) |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for c in args.levels:
        for mode in ("xpu", "auto"):
            s = res[mode][c]
            toks = sum(d["tokens"] for d in s["devices"].values()) or 1
            cpu = s["devices"].get(CPU, {"streams": 0, "stream_share": 0.0, "tokens": 0})
            dec = ", ".join(f"{k} {v}" for k, v in sorted(s["decisions"].items())) or "-"
            out.append(f"| {c} | {mode} | {s['completed']}/{s['completed'] + s['failed']} | {s['output_throughput']:.1f} | {s['steady_throughput']:.1f} | {s['median_ttft_ms']:.1f} | {s['p99_ttft_ms']:.1f} | {s['median_itl_ms']:.1f} | {s['p99_itl_ms']:.1f} | {cpu['streams']} ({cpu['stream_share']:.0%}) | {cpu['tokens'] / toks:.0%} | {dec} |")  # fmt: skip
    out += ["", "## Per device (the streams it decoded; tok/s: every token it produced, the first token of each stream being the xPU's prefill; 1st gap: first token to second, i.e. KV handoff and queueing; ms)", "", "| streams | decode_device | device | streams | tok/s | steady tok/s | TTFT p50 | 1st gap p50 | ITL p50 | ITL p99 |", "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for c in args.levels:
        for mode in ("xpu", "auto"):
            for dev, d in res[mode][c]["devices"].items():
                name = f"xPU (EMULATED {args.profile})" if dev == XPU else dev
                out.append(f"| {c} | {mode} | {name} | {d['streams']} | {d['tok_s']:.1f} | {d['steady_tok_s']:.1f} | {d['median_ttft_ms']:.1f} | {d['median_gap1_ms']:.1f} | {d['median_itl_ms']:.1f} | {d['p99_itl_ms']:.1f} |")  # fmt: skip
    errors = sorted({e for by in res.values() for s in by.values() for e in s["errors"]})
    out += ["", "## Done-when (issue 14)", ""] + verdict(args, res, cap) + [f"- error: {e}" for e in errors[:5]]  # fmt: skip
    return "\n".join(out)


def _ints(text: str) -> list[int]:
    try:
        xs = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        xs = []
    if not xs or xs[0] < 1:
        raise argparse.ArgumentTypeError(f"want levels >= 1 such as 1,4,16, got {text!r}")
    return xs


SERVE_OPTIONS = ("--client", "--endpoint", "--input-len", "--output-len", "--seed", "--tokenizer-model", "--json", "--cpu-workers", "--launch-timeout")  # fmt: skip
OPTIONS: list[tuple[str, dict[str, Any]]] = [
    ("--levels", {"type": _ints, "default": [1, 4, 8, 16, 32], "metavar": "C,C,...", "help": "closed-loop levels: streams in flight (default 1,4,8,16,32)"}),
    ("--slo-itl-ms", {"type": float, "default": 50.0, "help": "slo.itl_ms of the auto farm, and the bar of the CPU capacity and the done-when (default %(default)s)"}),
    ("--profile", {"default": "a10", "help": "xpu.profile of the EMULATED xPU: h100, a100-40gb, a10 (the slowest) or a profile file (default %(default)s)"}),
    ("--xpu-slots", {"type": int, "default": 4, "help": "xpu.max_batch_size: streams the EMULATED xPU runs at once; levels above it saturate it (default %(default)s)"}),
    ("--cpu-slots", {"type": int, "default": 8, "help": "cpu_max_batch_size: streams per CPU decode worker (default %(default)s)"}),
    ("--cpu-threads", {"type": int, "help": "cpu.threads of each CPU decode worker (default: syshax's, half the cores)"}),
    ("--cpu-nice", {"type": int, "help": "cpu.nice of the CPU decode workers, 0-19 (default: syshax's, 10; with --no-cpu-sched-idle)"}),
    ("--cpu-sched-idle", {"action": argparse.BooleanOptionalAction, "help": "cpu.sched_idle of the CPU decode workers (default: syshax's, on)"}),
    ("--capacity-levels", {"type": _ints, "metavar": "C,C,...", "help": "levels of the CPU capacity run (default: 1, 2, 4, ... up to the CPU workers' slots)"}),
    ("--capacity-stat", {"choices": ("p50", "p99"), "default": "p99", "help": "ITL statistic the CPU capacity keeps within the SLO (default %(default)s)"}),
    ("--num-prompts", {"type": int, "default": 32, "help": "fewest requests per level (default %(default)s)"}),
    ("--rounds", {"type": int, "default": 8, "help": "requests per level = max(--num-prompts, rounds x level) (default %(default)s)"}),
    ("--tolerance", {"type": float, "default": 0.10, "help": "below saturation, auto may be this fraction worse than xpu and pass (noise; default %(default)s)"}),
    ("--tolerance-ms", {"type": float, "default": 1.0, "help": "... plus this many ms (sub-ms ITLs; default %(default)s)"}),
    ("--load", {"type": Path, "help": "model file or folder of the farm (default: the bundled SmolLM2-135M)"}),
]  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    for flag, kwargs in [o for o in serve.OPTIONS if o[0] in SERVE_OPTIONS] + OPTIONS:
        p.add_argument(flag, **kwargs)
    # The light client by default: on 2 cores the openai client's CPU per token is taken from
    # the CPU decode workers, and `auto` streams 2.5x the tokens of the CPU capacity run.
    p.set_defaults(client="raw")
    args = p.parse_args(argv)
    if min(args.input_len, args.output_len, args.num_prompts, args.rounds, args.xpu_slots, args.cpu_slots, args.cpu_threads or 1) < 1 or not 0 <= (args.cpu_nice or 0) <= 19 or args.slo_itl_ms <= 0:  # fmt: skip
        p.error("lengths, counts and slots must be >= 1, --cpu-nice 0-19, --slo-itl-ms > 0")
    if not args.capacity_levels:
        top = args.cpu_slots * (args.cpu_workers or 1)
        args.capacity_levels = sorted({min(2**i, top) for i in range(top.bit_length() + 1)})
    args.request_rate = float("inf")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    tok = serve.load_tokenizer(args.tokenizer_model)
    most = max(sum(requests_at(args, c) for c in ls) for ls in (args.levels, args.capacity_levels))
    *prompts, warm = serve.make_prompts(args, tok, most + 1)
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    m = serve_report.machine()
    step = xpu_step_ms(args, args.xpu_slots)
    head = [
        f"# sysHAX farm, EMULATED xPU ({args.profile}) + real CPU decode workers",
        "",
        f"Date {date}; machine: {m['cpu']}, {m['cores']} cores, Python {m['python']}, {m['platform']}.",  # fmt: skip
        f"Command: `{shlex.join(['python', *sys.argv])}`",
        "",
        f"**The xPU is EMULATED** (xpu.engine: emulated, profile {args.profile}): no accelerator ran; each xPU step slept for the time the profile predicts for this model, and its text is meaningless. The CPU decode workers are real.",  # fmt: skip
        f"Farm: xPU {args.xpu_slots} slots (predicted decode step at {args.xpu_slots} streams: {f'{step:.2f} ms' if step else '?'}, so it saturates above {args.xpu_slots} streams), {args.cpu_workers or 1} CPU decode worker(s) x {args.cpu_slots} slots, cpu.threads {args.cpu_threads or 'default'}, cpu.nice {'default' if args.cpu_nice is None else args.cpu_nice}, cpu.sched_idle {'default' if args.cpu_sched_idle is None else args.cpu_sched_idle}, slo.itl_ms {args.slo_itl_ms:g} (auto only). Closed loop, {args.input_len} prompt tokens, {args.output_len} output tokens (ignore_eos), requests per level max({args.num_prompts}, {args.rounds} x level).",  # fmt: skip
    ]
    res = {"cpu": run_mode(args, "cpu", args.capacity_levels, prompts, warm)}
    res |= {mode: run_mode(args, mode, args.levels, prompts, warm) for mode in ("xpu", "auto")}
    cap = capacity_at_slo(list(res["cpu"].values()), args.slo_itl_ms, args.capacity_stat)
    print(tables(args, res, cap, head))
    if args.json:
        doc = {"date": date, "machine": m, "command": shlex.join(["python", *sys.argv]), "emulated_xpu": args.profile, "config": {k: str(v) if isinstance(v, Path) or v == float("inf") else v for k, v in vars(args).items()}, "cpu_capacity": cap and {k: v for k, v in cap.items() if k != "requests"}, "results": {mode: {str(c): s for c, s in by.items()} for mode, by in res.items()}}  # fmt: skip
        args.json.write_text(json.dumps(doc, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
