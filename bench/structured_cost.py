"""What structured outputs cost the engine (issue 28): the same batch of greedy requests decoded
with and without a JSON-schema constraint, in one process, alternating, so the difference is
the grammar's mask and matcher work on the engine's step (no farm, no client on the cores).
The engine runs as a CPU worker does: the GGUF's blocks with the fused native step.

    python bench/structured_cost.py --streams 1,16 --tokens 64 --rounds 3 [--model M.gguf]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import PEOPLE_SCHEMA  # noqa: E402 - the schema bench/serve.py --response-format uses


def run(engine, prompt_ids: list[int], streams: int, tokens: int, structured: bool) -> float:
    """Output tokens per second of `streams` requests decoded together."""
    from syshax.shared.sampling import SamplingParams

    spec = {"kind": "json_schema", "schema": PEOPLE_SCHEMA} if structured else None
    for i in range(streams):
        p = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, structured=spec)
        engine.add_request(f"r{i}", prompt_ids, p)
    t0, n = time.perf_counter(), 0
    while engine.has_unfinished():
        n += len(engine.step())
    return n / (time.perf_counter() - t0)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The flags of the structured-output benchmarks (this one, mask_share.py): the model, the
    stream counts and the tokens per request."""
    p.add_argument("--model", default=None, help="GGUF or HF folder (default: the bundled model)")
    p.add_argument("--streams", default="1,16", help="batch sizes, comma separated")
    p.add_argument("--tokens", type=int, default=64, help="generated tokens per request")


def cpu_engine(args: argparse.Namespace) -> tuple[Any, list[int], list[int]]:
    """(the engine as a CPU worker runs it: the workers' default kernels, `args.model`; the
    stream counts of `args.streams`; the prompt's ids, a request for people as JSON)."""
    from syshax.workers.cpu.options import CpuKernelOptions
    from syshax.workers.engine.engine import Engine
    from syshax.workers.engine.loader import resolve_model_path

    levels = [int(x) for x in args.streams.split(",")]
    path = resolve_model_path(args.model or "default")
    kernels = CpuKernelOptions().resolved(path, "cpu").engine_kwargs()  # the workers' default
    engine = Engine(path, max_model_len=1024, max_num_seqs=max(levels), progress=False, **kernels)  # fmt: skip
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": "List three people as JSON."}])  # fmt: skip
    return engine, levels, ids


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_engine_args(p)
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    args = p.parse_args()
    engine, levels, ids = cpu_engine(args)
    run(engine, ids, 2, 8, True)  # warm-up: kernels, the grammar's first compile
    print(
        f"{'streams':>7} {'free tok/s (rounds)':<30} {'json_schema tok/s (rounds)':<30} {'cost':>6}"
    )
    for level in levels:
        free, constrained = [], []
        for _ in range(args.rounds):
            free.append(run(engine, ids, level, args.tokens, False))
            constrained.append(run(engine, ids, level, args.tokens, True))
        cost = 1 - sorted(constrained)[len(constrained) // 2] / sorted(free)[len(free) // 2]
        fmt = lambda xs: ", ".join(f"{x:.1f}" for x in xs)  # noqa: E731
        print(f"{level:>7} {fmt(free):<30} {fmt(constrained):<30} {cost:>6.1%}")


if __name__ == "__main__":
    main()
