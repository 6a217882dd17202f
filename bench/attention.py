"""The fused step's attention kernel alone: time per layer and per (head, key) of
`sx_attend_heads_paged`, one thread, for a model's KV grouping over a paged cache.

Each call attends the query heads of one KV group over `--context` cached positions (blocks of
16 in shuffled order, as a long-running cache holds them); a "layer" is one call per KV group.
`--resident` reuses one layer's cache (it stays in L2/L3: the kernel's arithmetic), otherwise
every layer has its own cache (the step's case: the weights' stream has pushed the KV out of
cache). Best of `--repeats`.

    python bench/attention.py                                  # the 1B shape: 8 groups of 4, d 64
    python bench/attention.py --groups 4 --heads 7 --head-dim 128 --context 4000   # Qwen2-7B
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
from step_profile import hand_built
from syshax.workers.cpu import lib

BS = 16


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=2000, help="cached positions (default 2000)")
    p.add_argument("--groups", type=int, default=8, help="KV heads (default 8)")
    p.add_argument("--heads", type=int, default=4, help="query heads per KV head (default 4)")
    p.add_argument("--head-dim", type=int, default=64, help="head size (default 64)")
    p.add_argument(
        "--layers", type=int, default=16, help="layers, each with its cache (default 16)"
    )
    p.add_argument(
        "--kv", choices=("float16", "float32", "q8_0"), default="float16", help="cache type"
    )
    p.add_argument("--resident", action="store_true", help="one layer's cache, reused")
    p.add_argument("--repeats", type=int, default=20, help="timed passes (default 20)")
    p.add_argument("--variant", choices=("native", "portable"), default="native")
    p.add_argument(
        "--lib",
        type=Path,
        help="a kernels library built by hand (an A/B of two trees' attention.c), not --variant",
    )
    a = p.parse_args()

    so = hand_built(a.lib) if a.lib else lib.load(a.variant)
    fn = so.sx_attend_heads_paged  # raw: no per-call tensor handling
    torch.set_num_threads(1)
    g, h, d, ctx = a.groups, a.heads, a.head_dim, a.context
    blocks = ctx // BS + 2
    layers = 1 if a.resident else a.layers

    def cache() -> torch.Tensor:
        x = torch.randn(blocks, g, BS, d)
        if a.kv != "q8_0":
            return x.to(getattr(torch, a.kv))
        rows = lib.quantize(x.reshape(-1, d), lib.Q8_0)  # rows of Q8_0 blocks, as the cache
        return rows.reshape(blocks, g, BS, rows.shape[1])

    caches = [(cache(), cache()) for _ in range(layers)]
    table = torch.randperm(blocks).to(torch.int32)
    q, out = torch.randn(g, h, d), torch.empty(g, h, d)
    kn, vn, scores = torch.randn(d), torch.randn(d), torch.empty(h, ctx + 1)

    args = [(q[i].data_ptr(), out[i].data_ptr(), i * BS * d) for i in range(g)]
    kind, scale = lib.kv_type_of(caches[0][0].dtype), 1 / math.sqrt(d)
    tp, knp, vnp, sp = table.data_ptr(), kn.data_ptr(), vn.data_ptr(), scores.data_ptr()

    def layer(k: torch.Tensor, v: torch.Tensor) -> None:
        kp, vp = k.data_ptr(), v.data_ptr()
        for qp, op, head in args:
            fn(
                qp,
                h,
                kp,
                vp,
                kind,
                tp,
                BS,
                g * BS * d,
                head,
                ctx,
                knp,
                vnp,
                d,
                scale,
                sp,
                ctx + 1,
                op,
            )

    passes = a.layers if a.resident else 1
    best = math.inf
    for _ in range(a.repeats + 1):  # the first pass warms up
        t0 = time.perf_counter()
        for _ in range(passes):
            for k, v in caches:
                layer(k, v)
        best = min(best, (time.perf_counter() - t0) / a.layers)
    pairs = g * h * ctx
    where = "resident" if a.resident else "a cache per layer"
    print(
        f"context {ctx}, {g} KV heads x {h} query heads, d {d}, {a.kv} ({where}), "
        f"{a.lib or a.variant}: "
        f"{best * 1e3:.3f} ms per layer, {best * 1e9 / pairs:.2f} ns per (head, key), "
        f"{a.layers} layers {best * a.layers * 1e3:.2f} ms (one thread)"
    )


if __name__ == "__main__":
    main()
