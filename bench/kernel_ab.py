"""Two builds of the CPU kernels side by side: fused steps of one GGUF, alternating in one process.

An A/B of a kernel change: build the other tree's kernels by hand (the same flags as build.py),
then time the same fused step on both, round by round, after checking that both give the same
logits (a kernel change that is meant to keep the bits must keep them):

    gcc -O3 -std=gnu11 -fPIC -shared -fopenmp -ffp-contract=off -march=native \\
        -o /tmp/old.so OLD_TREE/workers/cpu/native/*.c -lm
    python bench/kernel_ab.py /tmp/old.so --model FILE.gguf --rows-list 64,128,256
    python bench/kernel_ab.py /tmp/old.so --model FILE.gguf --rows-list 8,16 --decode --amx off

Prints per row count the speed of this tree's build over the other's (median of the rounds) and
this tree's tokens per second. `--allow-different` times builds whose logits differ.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def step_rows(n: int, decode: bool, block_size: int) -> tuple:
    """A fused step's arguments: a prompt chunk of n rows, or n sequences of one row each."""
    if decode:  # n sequences at position 128, one row each
        per = 256 // block_size
        tables = [list(range(s * per, (s + 1) * per)) for s in range(n)]
        return list(range(1, n + 1)), [128] * n, list(range(n)), tables, list(range(n))
    tables = [list(range((n + block_size - 1) // block_size))]  # one prompt chunk of n rows
    return list(range(1, n + 1)), list(range(n)), [0] * n, tables, [n - 1]


def _seconds(fused, rows: tuple, repeats: int) -> float:
    fused.step(*rows)
    started = time.perf_counter()
    for _ in range(repeats):
        fused.step(*rows)
    return (time.perf_counter() - started) / repeats


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("other", type=Path, help="the other build's kernels library (.so)")
    p.add_argument("--model", type=Path, required=True, help="a GGUF, loaded as a worker loads it")
    p.add_argument("--rows-list", default="64,128", help="rows per step (prompt rows, or sequences with --decode)")  # fmt: skip
    p.add_argument(
        "--decode", action="store_true", help="n sequences of one row, not one prompt of n"
    )
    p.add_argument("--amx", choices=("on", "off"), default="on", help="Intel AMX in both builds, where the CPU has it")  # fmt: skip
    p.add_argument("--threads", type=int, default=2, help="kernel threads")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds")
    p.add_argument("--repeats", type=int, default=5, help="steps timed per round and build")
    p.add_argument("--allow-different", action="store_true", help="time builds whose logits differ")
    args = p.parse_args(argv)

    import torch
    from syshax.shared import env
    from syshax.workers.cpu import lib
    from syshax.workers.cpu.fused import FusedDecoder
    from syshax.workers.engine.engine import Engine

    own = lib.library_path
    lib.library_path = lambda variant: args.other if variant == "other" else own(variant)
    env.prefer_eager_huge_pages()  # load as a worker does
    ns = _ints(args.rows_list)
    eng = Engine(args.model, quantize="stored", op_mode="fused", max_model_len=1024, max_num_seqs=max(ns), progress=False, load_tokenizer=False)  # fmt: skip
    ours = eng.fused
    other = FusedDecoder(eng.model, eng.cache, threads=args.threads, max_tokens=max(ns), variant="other")  # fmt: skip
    for variant in ("native", "other"):
        lib.load(variant).sx_amx_enable(int(args.amx == "on"))
    what = "decode" if args.decode else "prompt"
    for n in ns:
        rows = step_rows(n, args.decode, eng.cache.block_size)
        same = torch.equal(ours.step(*rows).clone(), other.step(*rows).clone())
        if not same and not args.allow_different:
            print(
                f"{what} n={n}: the two builds' logits differ (--allow-different times them anyway)"
            )
            return 1
        ratios, speeds = [], []
        for _ in range(args.rounds):
            theirs, mine = _seconds(other, rows, args.repeats), _seconds(ours, rows, args.repeats)
            ratios.append(theirs / mine)
            speeds.append(n / mine)
        rounds = ", ".join(f"{r:.3f}" for r in ratios)
        print(
            f"{args.model.name} {what} n={n} amx {args.amx}: this tree / other "
            f"{statistics.median(ratios):.3f}x (rounds {rounds}), this tree "
            f"{statistics.median(speeds):.1f} tok/s, logits {'the same' if same else 'DIFFERENT'}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
