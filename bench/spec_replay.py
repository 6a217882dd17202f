"""Speculation replayed from one greedy run: how many verify steps and rows a proposer and k
policy need, without the model, so proposers are compared load-independently.

Greedy decoding is deterministic and speculation keeps its text, so a proposer's whole effect
at 1 stream is in two counts: the verify steps a prompt takes and the rows they compute. The
`trace` command runs each grounded prompt once without speculation on the speed model
(bench/spec_model.py), 1 stream, and keeps its prompt and output ids, the prefill step's time
and the decode steps' times, and the fused step's time for 1..16 rows of one sequence. `replay`
feeds those ids to workers/engine/speculative.py's policy exactly as the scheduler does (one
sequence, its drafts checked against the output the model gave), and prints per prompt the
steps, rows, acceptance, tokens per step and a time estimate from the traced costs: prefill +
the sum of each verify step's cost at its row count.

    python bench/spec_replay.py trace --threads 2      # writes ~/.cache/syshax/bench/spec_trace.json
    python bench/spec_replay.py replay                 # the policy as configured now
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TRACE = Path("~/.cache/syshax/bench/spec_trace.json").expanduser()
ROWS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)


def trace(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(HERE))
    from spec import load_prompts
    from spec_model import speed_model
    from syshax.shared.sampling import SamplingParams
    from syshax.workers.engine.engine import Engine

    model = args.model or speed_model(args.threads)
    eng = Engine(model, quantize="stored", op_mode="fused", max_model_len=1024, max_num_seqs=1, progress=False, prefix_caching=False)  # fmt: skip
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    prompts = load_prompts(args.prompts)
    runs = []
    for i, p in enumerate([prompts[0], *prompts]):  # the first one twice: a warm-up
        ids = eng.tokenizer.encode_chat(p["messages"])
        eng.add_request(f"r{i}", ids, params)
        out, times, cpu, done = [], [], [], False
        while not done:
            started, cpu0 = time.perf_counter(), time.process_time()
            for o in eng.step():
                out.append(o.token_id)
                done = o.finish_reason is not None
            times.append(time.perf_counter() - started)
            cpu.append(time.process_time() - cpu0)  # CPU seconds: less load-bound at 1 thread
        runs.append({"name": p["name"], "prompt": ids, "output": out, "prefill_s": times[0], "decode_s": times[1:], "prefill_cpu": cpu[0], "decode_cpu": sum(cpu[1:])})  # fmt: skip
    costs = _row_costs(eng, args.steps)
    out = {"model": str(model), "threads": args.threads, "max_tokens": args.max_tokens, "load": os.getloadavg(), "runs": runs[1:], "row_costs": costs}  # fmt: skip
    args.trace.write_text(json.dumps(out))
    for r in runs[1:]:
        print(f"{r['name']:<16} prompt {len(r['prompt']):>4}  output {len(r['output']):>3}  prefill {r['prefill_s'] * 1e3:6.1f} ms ({r['prefill_cpu'] * 1e3:6.1f} CPU)  decode {sum(r['decode_s']) * 1e3:7.1f} ms ({r['decode_cpu'] * 1e3:7.1f} CPU)")  # fmt: skip
    print("fused step of n rows of one sequence (ms, median):", {n: round(s * 1e3, 1) for n, s in costs.items()})  # fmt: skip


def _row_costs(eng: Any, steps: int) -> dict[int, float]:
    """Median seconds of a fused step of n rows (every row's logits) at position ~100."""
    fused, table = eng.fused, list(range(16))
    fused.step(list(range(1, 101)), list(range(100)), [0] * 100, [table], [99])
    times: dict[int, list[float]] = {n: [] for n in ROWS}
    for _ in range(steps):  # sizes interleaved: the machine's drift hits all
        for n in ROWS:
            started = time.perf_counter()
            fused.step(list(range(1, n + 1)), list(range(100, 100 + n)), [0] * n, [table], list(range(n)))  # fmt: skip
            times[n].append(time.perf_counter() - started)
    return {n: statistics.median(t) for n, t in times.items()}


def replay_one(policy: Any, prompt: list[int], output: list[int], cost, max_tokens: int) -> dict[str, float]:  # fmt: skip
    """One sequence through the policy as Scheduler._speculate/_count_decode drive it: the
    first output token comes from the prefill; each later step asks k, proposes, verifies
    against `output`, and moves on by the accepted drafts plus the target's own token."""
    from syshax.shared.sampling import SamplingParams
    from syshax.workers.engine.sequence import Sequence

    seq = Sequence("replay", list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0))
    done, steps, rows, proposed, accepted, seconds = 1, 0, 0, 0, 0, 0.0
    while done < len(output):
        seq.output_ids = list(output[:done])
        k = min(policy.wanted(seq.acceptance, 1, policy.draft_rows_each(1)), max_tokens - done - 1)
        draft = policy.propose(seq.all_ids, k, seq, 1) if k >= 1 else []
        if k < 1:
            seq.acceptance = policy.recovered(seq.acceptance)
        n = 0
        while n < len(draft) and done + n < len(output) and draft[n] == output[done + n]:
            n += 1
        if draft:
            seq.acceptance = policy.updated(seq.acceptance, len(draft), n)
        step_s = cost(1 + len(draft))
        steps, rows, seconds = steps + 1, rows + 1 + len(draft), seconds + step_s
        proposed, accepted, done = proposed + len(draft), accepted + n, done + n + 1
        policy.observe_step(1 + len(draft), step_s)
    return {"steps": steps, "rows": rows, "proposed": proposed, "accepted": accepted, "seconds": seconds}  # fmt: skip


def replay(args: argparse.Namespace) -> None:
    from syshax.workers.engine.speculative import SpecConfig, SpecPolicy

    data = json.loads(args.trace.read_text())
    table = {int(n): s for n, s in data["row_costs"].items()}
    if args.costs:  # "rows:ms,..." instead of the traced step times
        table = {int(n): float(ms) / 1e3 for n, ms in (kv.split(":") for kv in args.costs.split(","))}  # fmt: skip
    cost = lambda n: _interp(table, n)  # noqa: E731
    ms = {n: round(v * 1e3, 1) for n, v in table.items()}
    print(f"trace: {data['model']}, {data['threads']} threads, load at trace {data['load'][0]:.2f}; step ms by rows {ms}")  # fmt: skip
    print(f"{'prompt':<16} {'in':>4} {'out':>4} {'prefill ms':>10} {'decode ms':>9} {'steps':>6} {'rows':>5} {'acc':>5} {'tok/step':>8} {'est s':>6}")  # fmt: skip
    tot = {"in": 0, "out": 0, "prefill": 0.0, "decode": 0.0, "steps": 0, "rows": 0, "proposed": 0, "accepted": 0, "est": 0.0}  # fmt: skip
    policy = SpecPolicy(SpecConfig(method=args.method, num_tokens=args.num_tokens))
    for r in data["runs"]:  # one engine serves the prompts in turn: class records carry over
        res = replay_one(policy, r["prompt"], r["output"], cost, data["max_tokens"])
        dec = len(r["output"]) - 1
        acc = res["accepted"] / res["proposed"] if res["proposed"] else 0.0
        est = r["prefill_s"] + res["seconds"]
        print(f"{r['name']:<16} {len(r['prompt']):>4} {len(r['output']):>4} {r['prefill_s'] * 1e3:>10.1f} {sum(r['decode_s']) * 1e3:>9.1f} {res['steps']:>6} {res['rows']:>5} {acc:>5.2f} {dec / max(res['steps'], 1):>8.2f} {est:>6.2f}")  # fmt: skip
        for key, v in (("in", len(r["prompt"])), ("out", len(r["output"])), ("prefill", r["prefill_s"]), ("decode", sum(r["decode_s"])), ("est", est)):  # fmt: skip
            tot[key] += v
        for key in ("steps", "rows", "proposed", "accepted"):
            tot[key] += res[key]
    plain_s = tot["prefill"] + tot["decode"]
    print(f"total: {tot['in']} prompt tokens, {tot['out']} output tokens; traced plain {plain_s:.2f} s ({tot['out'] / plain_s:.1f} tok/s), prefill {tot['prefill']:.2f} s ({tot['prefill'] / plain_s:.0%})")  # fmt: skip
    decoded = tot["out"] - len(data["runs"])  # the first token of each comes with its prefill
    spec_s, plain_dec = tot["est"] - tot["prefill"], decoded * cost(1)
    print(f"  {args.method}: {tot['steps']} verify steps, {tot['rows']} rows ({tot['rows'] / max(tot['steps'], 1):.2f} per step), acceptance {tot['accepted'] / max(tot['proposed'], 1):.2f}, tokens/step {decoded / max(tot['steps'], 1):.2f}; decode by the step costs {spec_s:.2f} s vs {plain_dec:.2f} s plain ({plain_dec / spec_s:.2f}x)")  # fmt: skip
    if not args.costs:
        print(f"  with the traced prefill: est. {tot['out'] / tot['est']:.1f} tok/s ({plain_s / tot['est']:.2f}x the traced plain run)")  # fmt: skip
    print(f"  bound with free decode: {tot['out'] / tot['prefill']:.1f} tok/s (prefill alone)")


def _interp(table: dict[int, float], n: int) -> float:
    if n in table:
        return table[n]
    lo = max(k for k in table if k < n)
    hi = min((k for k in table if k > n), default=None)
    if hi is None:
        return table[lo]
    return table[lo] + (table[hi] - table[lo]) * (n - lo) / (hi - lo)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("command", choices=("trace", "replay"))
    p.add_argument("--trace", type=Path, default=TRACE, help="the trace file (default: %(default)s)")  # fmt: skip
    p.add_argument("--model", type=Path, default=None, help="trace: GGUF (default: the padded SmolLM2)")  # fmt: skip
    p.add_argument("--prompts", type=Path, default=HERE / "prompts" / "grounded.jsonl")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--max-tokens", type=int, default=64, help="trace: most tokens per answer (default 64, as the benchmark's figures)")  # fmt: skip
    p.add_argument("--steps", type=int, default=5, help="trace: timed steps per row count")
    p.add_argument("--method", default="ngram", help="replay: speculative.method")
    p.add_argument("--num-tokens", type=int, default=5, help="replay: speculative.num_tokens")
    p.add_argument("--costs", default=None, help="replay: step ms by rows, e.g. 1:53.1,2:64.8,16:213.8 (default: the traced ones)")  # fmt: skip
    args = p.parse_args(argv)
    trace(args) if args.command == "trace" else replay(args)


if __name__ == "__main__":
    main()
