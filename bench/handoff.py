"""What a KV handoff costs the CPU decode worker that receives it, piece by piece, at the bundled
model's shape and at real ones (Llama-3.2-1B, Llama-3.1-8B: the KV per token and the layers).

    python bench/handoff.py --tokens 128,1024 --rounds 20

For each shape and prompt length: the blob's size; `put` (the producer's copy into a fresh
shared-memory segment and the lease in Redis); the consumer's read as a copy (`KVStore.take`,
what the worker did before) and as a view (`KVStore.taken`, what it does now); and the cache
write of the import (`KVCache.write`, from the view). Medians over --rounds, in ms; the
"saved" column is the copy the view avoids. Needs the farm's Redis: --redis-url, or an
embedded one is started. The model itself is not loaded (the shapes are the models' configs).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace

import torch

SHAPES = {  # name: (layers, kv heads, head dim), from the models' config.json
    "SmolLM2-135M": (30, 3, 64),
    "Llama-3.2-1B": (16, 8, 64),
    "Llama-3.1-8B": (32, 8, 128),
}


def _config(layers: int, kv_heads: int, head_dim: int):
    from syshax.workers.engine.config import ModelConfig

    base = ModelConfig("LlamaForCausalLM", 1000, 64, 128, 1, 1, 1, 64, 1e-5, 1e4, 4096, True, False, False)  # fmt: skip
    return replace(base, num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, num_heads=kv_heads)  # fmt: skip


def measure(r, name: str, tokens: int, rounds: int) -> dict[str, float]:
    from syshax.broker.keys import Keys
    from syshax.broker.kv_store import KVStore
    from syshax.workers.engine import kv_format
    from syshax.workers.engine.kv_cache import KVCache
    from syshax.workers.engine.kv_identity import KVIdentity

    cfg = _config(*SHAPES[name])
    kv = KVStore(r, Keys("bench-handoff"), ttl=60, worker_id="bench")
    shape = (cfg.num_layers, cfg.num_kv_heads, tokens, cfg.head_dim)
    keys, values = torch.randn(shape).half(), torch.randn(shape).half()
    blob = kv_format.encode(cfg, keys, values, 1, identity=KVIdentity("bench", "bench"))
    size = 16
    cache = KVCache(cfg, -(-tokens // size) + 1, size, torch.float16, "cpu")
    table = list(range(-(-tokens // size)))
    times: dict[str, list[float]] = {"put": [], "take (copy)": [], "taken (view)": [], "cache write": []}  # fmt: skip
    for _ in range(rounds):
        t0 = time.perf_counter()
        h = kv.put(blob, {}, "bench", "shm")
        t1 = time.perf_counter()
        kv.take(h)
        t2 = time.perf_counter()
        h = kv.put(blob, {}, "bench", "shm")
        t3 = time.perf_counter()
        with kv.taken(h) as view:
            t4 = time.perf_counter()
            _, k, v = kv_format.decode(view)
            cache.write(table, k, v)
            del k, v
            t5 = time.perf_counter()
        times["put"].append(t1 - t0)
        times["take (copy)"].append(t2 - t1)
        times["cache write"].append(t5 - t4)
        times["taken (view)"].append(time.perf_counter() - t3 - (t5 - t4))
    out = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return {"MB": len(blob) / 2**20, **out}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--tokens", default="128,1024", help="prompt lengths, comma-separated (default %(default)s)")  # fmt: skip
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"model shapes, of {', '.join(SHAPES)} (default: all)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=20, help="handoffs per row; medians (default %(default)s)")  # fmt: skip
    p.add_argument("--redis-url", help="a Redis to use (default: an embedded one, started here)")
    args = p.parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",")]
    shapes = args.shapes.split(",")
    if bad := [s for s in shapes if s not in SHAPES]:
        p.error(f"unknown shapes {bad}; known: {', '.join(SHAPES)}")
    import redis

    embedded = None
    if args.redis_url is None:
        from syshax.broker.embedded import EmbeddedRedis

        embedded = EmbeddedRedis().start()
    r = redis.Redis.from_url(args.redis_url or embedded.url)
    try:
        print("| shape | tokens | blob MB | put | take (copy) | taken (view) | saved | cache write |")  # fmt: skip
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for name in shapes:
            for n in tokens:
                m = measure(r, name, n, args.rounds)
                saved = m["take (copy)"] - m["taken (view)"]
                print(f"| {name} | {n} | {m['MB']:.1f} | {m['put']:.2f} | {m['take (copy)']:.2f} | {m['taken (view)']:.2f} | {saved:.2f} | {m['cache write']:.2f} |", flush=True)  # fmt: skip
    finally:
        if embedded is not None:
            embedded.stop()
    print(f"\nms, medians of {args.rounds}; machine: {sys.platform}, torch threads {torch.get_num_threads()}")  # fmt: skip


if __name__ == "__main__":
    main()
