"""Intel AMX against the VNNI tiles in one process, alternating: GEMMs and fused steps.

`gemm`: Q4_0, Q4_1, Q8_0, Q4_K, Q5_K or Q6_K matrices of the shapes the models here have (random weights), n
activation rows,
timed with AMX off and on in turn (sx_amx_enable), GMAC/s of each and on / off.
`step`: one fused step of n prompt rows of one sequence (a prefill chunk; with
`--decode` n sequences of one row each, a decode batch) on a GGUF as a worker loads it, AMX off
and on in turn: ms per step and prompt (or decode) tokens per second.

    python bench/amx_rows.py gemm --rows-list 16,64,128
    python bench/amx_rows.py step --model ~/.cache/syshax/bench/shapes/1b.random.Q4_0.gguf

Both print each round; compare the medians. The results are the same bits either way
(tests/workers/cpu/test_amx.py), so only the time differs.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from pathlib import Path

SHAPES = {  # rows x cols of the Q4_0 matrices the benches use
    "1b_gate_up": (16384, 2048),
    "1b_down": (2048, 8192),
    "1b_qkv": (3072, 2048),
    "padded_ffn": (32768, 576),
    "padded_down": (576, 16384),
}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _timed(fn, repeats: int) -> float:
    fn()  # warm: the thread's tile state and buffers, the weights' pages
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - started) / repeats


def _compare(native, label: str, work: float, unit: str, fn, rounds: int, repeats: int) -> None:
    """Rounds of (off, on); work per call in `unit`s (GMAC, tokens)."""
    ratios = []
    for i in range(rounds):
        native.sx_amx_enable(0)
        off = _timed(fn, repeats)
        native.sx_amx_enable(1)
        on = _timed(fn, repeats)
        ratios.append(off / on)
        print(
            f"{label} round {i}: vnni {work / off:8.1f} {unit}  amx {work / on:8.1f} {unit}"
            f"  ({off * 1e3:.2f} / {on * 1e3:.2f} ms)  amx/vnni {off / on:.2f}x",
            flush=True,
        )
    print(f"{label}: median amx/vnni {statistics.median(ratios):.2f}x", flush=True)


def _matrix(qtype: str, rows: int, cols: int):
    """A packed matrix of random weights: Q4_0 / Q8_0 quantized from normal floats; Q4_1, Q4_K,
    Q5_K and Q6_K random blocks with small finite scales (no quantizer for them here; speed only)."""
    import numpy as np
    import torch
    from syshax.workers.cpu import lib

    if qtype in ("q4_0", "q8_0"):
        t = lib.QTYPES[qtype]
        return lib.quant_mat(t, lib.quantize(torch.randn(rows, cols), t), rows, cols)
    t = {"q4_1": lib.Q4_1, "q4_k": lib.Q4_K, "q5_k": lib.Q5_K, "q6_k": lib.Q6_K}[qtype]
    rng = np.random.default_rng(0)
    nb, bb = cols // lib.BLOCK_ELEMS[t], lib.BLOCK_BYTES[t]
    blocks = rng.integers(0, 256, size=(rows, nb, bb), dtype=np.uint8)
    for off in (208,) if t == lib.Q6_K else (0, 2):  # d and m (K-quants: dmin; Q6_K: d only, last)
        d = (rng.standard_normal((rows, nb)) * 0.01).astype(np.float16)
        blocks[..., off : off + 2] = d.view(np.uint8).reshape(rows, nb, 2)
    return lib.quant_mat(t, torch.from_numpy(blocks.reshape(rows, nb * bb)), rows, cols)


def gemm(args, native) -> None:
    import torch
    from syshax.workers.cpu import lib

    for name in args.shapes.split(","):
        rows, cols = SHAPES[name]
        mat = _matrix(args.type, rows, cols)
        for n in _ints(args.rows_list):
            x = torch.randn(n, cols)
            gmac = rows * cols * n / 1e9
            # one y for every call: a fresh one of tens of MB would fault in new pages each call
            y = torch.empty(n, rows)
            fn = functools.partial(lib.gemm, mat, x, threads=args.threads, out=y)
            label = f"{args.type} {name} {rows}x{cols} n={n}"
            _compare(native, label, gmac, "GMAC/s", fn, args.rounds, args.repeats)


def step(args, native) -> None:
    from syshax.shared import env
    from syshax.workers.engine.engine import Engine

    env.prefer_eager_huge_pages()  # load as a worker does
    eng = Engine(args.model, quantize="stored", op_mode="fused", max_model_len=1024, max_num_seqs=max(_ints(args.rows_list)), progress=False, load_tokenizer=False)  # fmt: skip
    from kernel_ab import step_rows

    fused = eng.fused
    for n in _ints(args.rows_list):
        rows = step_rows(n, args.decode, eng.cache.block_size)
        what = "decode" if args.decode else "prompt"
        fn = functools.partial(fused.step, *rows)
        _compare(native, f"{what} n={n}", n, "tok/s", fn, args.rounds, args.repeats)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument(
        "mode", choices=("gemm", "step"), help="GEMMs of single matrices, or fused steps"
    )
    p.add_argument(
        "--shapes", default=",".join(SHAPES), help=f"gemm: matrices, of {', '.join(SHAPES)}"
    )
    p.add_argument(
        "--type",
        choices=("q4_0", "q4_1", "q8_0", "q4_k", "q5_k", "q6_k"),
        default="q4_0",
        help="gemm: weight type",
    )
    p.add_argument(
        "--model", type=Path, default=None, help="step: a GGUF (default: the padded SmolLM2)"
    )
    p.add_argument(
        "--decode", action="store_true", help="step: n sequences of one row, not one prompt of n"
    )
    p.add_argument("--rows-list", default="16,32,64,128", help="activation rows per call / step")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="kernel threads")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds of off / on")
    p.add_argument("--repeats", type=int, default=5, help="calls timed per round and setting")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    from syshax.workers.cpu import lib

    native = lib.load()
    if not native.sx_amx_enable(1):
        sys.exit("no AMX here: this bench needs an Intel CPU with AMX-INT8 and Linux >= 5.16")
    print(f"kernels: {native.sx_simd().decode()}, {args.threads} thread(s)", flush=True)
    if args.mode == "gemm":
        gemm(args, native)
    else:
        if args.model is None:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from spec_model import speed_model

            args.model = speed_model(args.threads)
        step(args, native)


if __name__ == "__main__":
    main()
