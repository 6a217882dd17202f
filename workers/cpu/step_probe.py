"""Measure a CPU decode worker's step curve: seconds per engine step at several batch sizes.

`syshax plan` runs this as a subprocess per worker of a layout, all of a layout's workers at
once (they share the memory bandwidth, as real workers do), and fits `base + per_row * rows`
to the medians (workers/capacity_plan.py). It loads the model as a CPU decode worker would
(the native kernels' default rule, the environment's SYSHAX_QUANTIZE / INFERENCE_OP_MODE),
with `threads` threads pinned to `cpus` if given, and times decode steps only: each batch's
sequences are prefilled first, at the workload's mean context, then `steps` steps are timed
one by one.

    python -m syshax.workers.cpu.step_probe --model default --threads 2 --batches 1,2,4,8
prints one JSON object: {"threads", "cpus", "kernels", "batches": {rows: [seconds, ...]}}.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time


def probe(
    model: str,
    threads: int,
    batches: list[int],
    context: int,
    steps: int,
    cpus: list[int] | None = None,
) -> dict:
    import torch
    from syshax.shared.sampling import SamplingParams
    from syshax.workers.cpu.options import from_env, pin_threads
    from syshax.workers.engine.engine import Engine

    opts = from_env(threads)
    if cpus:
        import dataclasses

        opts = dataclasses.replace(opts, cpus=tuple(cpus))
    opts = opts.resolved(model, "cpu")
    torch.set_num_threads(threads)
    if opts.cpus:
        pin_threads(opts)
    top = max(batches)
    eng = Engine(model, device="cpu", max_model_len=context + steps + 8, max_num_seqs=top, max_num_batched_tokens=max(256, top), prefix_caching=False, progress=False, load_tokenizer=False, **opts.engine_kwargs())  # fmt: skip
    rng = random.Random(0)
    out: dict[str, list[float]] = {}
    for rows in batches:
        params = SamplingParams(max_tokens=steps + 4, temperature=0.0, seed=0, ignore_eos=True)
        ids = [f"b{rows}-{i}" for i in range(rows)]
        for rid in ids:
            eng.add_request(rid, [rng.randrange(100, 30000) for _ in range(context)], params)
        started: set[str] = set()
        while len(started) < rows:  # prefill every sequence (and sample its first token)
            started |= {o.request_id for o in eng.step()}
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - t)
        for rid in ids:
            eng.abort(rid)
        out[str(rows)] = times
    return {"threads": threads, "cpus": list(opts.cpus or []), "kernels": f"{opts.quantize or 'float'}/{opts.op_mode or 'torch'}", "batches": out}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help="GGUF file or HF folder ('default' = the bundled model)")  # fmt: skip
    p.add_argument("--threads", type=int, default=1, help="threads of this worker (default 1)")
    p.add_argument("--cpus", default="", help="CPUs to pin thread i to, comma-separated (default: not pinned)")  # fmt: skip
    p.add_argument("--batches", default="1,2,4,8", help="batch sizes to time (default 1,2,4,8)")
    p.add_argument("--context", type=int, default=192, help="tokens already in each sequence when its steps are timed (default 192)")  # fmt: skip
    p.add_argument("--steps", type=int, default=12, help="timed steps per batch size (default 12)")  # fmt: skip
    args = p.parse_args(argv)
    from syshax.workers.engine.loader import resolve_model_path

    result = probe(
        str(resolve_model_path(args.model)),
        args.threads,
        [int(b) for b in args.batches.split(",")],
        args.context,
        args.steps,
        [int(c) for c in args.cpus.split(",") if c.strip()] or None,
    )
    result["pid"] = os.getpid()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
