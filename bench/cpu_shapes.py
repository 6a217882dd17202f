"""CPU decode at real model shapes: our kernels vs llama.cpp on the same random-weight GGUFs.

`python bench/cpu_decode.py --shape 1b|3b|8b|qwen7b` runs this. For each --shape-types entry
the file is made by bench/gguf_shapes.py (random weights with a public model's shape, SmolLM2's
tokenizer, quantized by llama.cpp's own quantizer: SPEED ONLY, the text is meaningless), then
each engine runs in a child process of its own, so its load time and peak RSS are its own:

* syshax: `Engine(quantize="stored", op_mode="fused")`, the CPU default for a GGUF: the
  file's blocks as stored, the fused decode step;
* llama.cpp: llama-cpp-python (its libraries swapped for a native build with
  LLAMA_CPP_LIB_PATH, see bench/llama_native.sh), the same file, the same threads.

Each child starts with the file in the page cache (read once before it starts). Reported per
engine: load seconds, peak RSS (VmHWM) and RSS after the runs, prefill tok/s,
decode tok/s at each batch, our ratio to llama.cpp, and batch 1 against the bandwidth limit
(measured GB/s / bytes read per token: every matrix as stored + one embedding row). The
bandwidth is sampled right before and right after each engine's child and the higher sample
taken for that row: on a shared VM it can double or halve within seconds (31 and 56 GB/s
seconds apart on a Zen 4 VM), so one figure per run made the percentages meaningless. For
the same reason `--rounds N` runs both engines N times, alternating, pairs each of our runs
with the llama.cpp run right after it, and prints the median of the paired ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import engine as engine_bench  # noqa: E402
import gguf_shapes  # noqa: E402


def _status(key: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    return 0


def child(args: argparse.Namespace) -> None:
    """Run one engine on one file; print its row as JSON on the last line."""
    import cpu_decode

    path = Path(args.child_model)
    threads, prompts, _ = engine_bench.setup(args, path)
    if args.child == "syshax":
        from syshax.workers.cpu import lib

        lib.load()  # a first-run compile is not load time
        row = cpu_decode.bench_ours(args, path, prompts, "stored", "fused")
    else:
        row = cpu_decode.bench_llama(args, path, prompts, "stored", threads)
    out = asdict(row) | {"peak_rss": _status("VmHWM:"), "rss": _status("VmRSS:")}
    print(json.dumps(out))


def warm_page_cache(path: Path) -> None:
    """Read the file once so every engine starts from the same warm page cache: llama.cpp maps
    the file lazily (its load time reads nothing), ours packs it (reads everything), so a cold
    cache would be charged to whichever engine reads first."""
    buf = bytearray(64 * 2**20)
    with open(path, "rb", buffering=0) as fh:
        while fh.readinto(buf):
            pass


def read_bytes_per_token(path: Path) -> int:
    """Bytes a batch-1 decode step reads: every 2-D tensor but the embedding (the LM head is
    the embedding when tied) as stored, plus one embedding row."""
    from syshax.workers.engine.gguf_weights import open_gguf

    gg = open_gguf(path)
    total = sum(t.nbytes for n, t in gg.tensors.items() if len(t.shape) == 2)
    embed = gg.tensors["model.embed_tokens.weight"]
    if "lm_head.weight" in gg.tensors:
        total -= embed.nbytes
    return total + embed.nbytes // embed.shape[0]


def run(args: argparse.Namespace) -> None:
    import cpu_decode

    # Only the threads and the machine here (each child makes its prompts from its file); the
    # bundled model has the tokenizer every shape uses, so nothing warns about a missing one.
    from syshax.shared.default_model import default_model_path

    threads, _, info = engine_bench.setup(args, default_model_path())
    info["model"] = f"{args.shape} shape, random weights"
    info["bandwidth_gbs"] = cpu_decode.bandwidth_gbs(args.bandwidth_mb)
    info.update(cpu_decode.simd_info())
    print(f"# memory bandwidth: {info['bandwidth_gbs']:.1f} GB/s ({threads} threads)", flush=True)
    model = gguf_shapes.SHAPES[args.shape][0]
    print(f"# {args.shape}: random weights in {model}'s shape (speed only)", flush=True)
    rows = []
    for ftype in args.shape_types:
        path = gguf_shapes.shaped(args.shape, ftype, threads)
        size = path.stat().st_size
        per_token = read_bytes_per_token(path)
        for rnd, eng in [
            (r, e) for r in range(1, args.rounds + 1) for e in ("syshax", "llama.cpp")
        ]:
            if eng in args.skip:
                continue
            cmd = [sys.executable, __file__, "--child", eng, "--child-model", str(path)]
            cmd += ["--threads", str(threads), "--batches", ",".join(map(str, args.batches))]
            cmd += ["--new-tokens", str(args.new_tokens), "--prompt-tokens", str(args.prompt_tokens)]  # fmt: skip
            cmd += ["--repeats", str(args.repeats)]
            print(f"# running {eng} on {path.name} ...", file=sys.stderr, flush=True)
            warm_page_cache(path)
            before = cpu_decode.bandwidth_gbs(args.bandwidth_mb)
            proc = subprocess.run(cmd, capture_output=True, text=True)
            bandwidth = max(before, cpu_decode.bandwidth_gbs(args.bandwidth_mb))
            if proc.returncode != 0:
                print(f"# {eng} {ftype} failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
                continue
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            row.update(round=rnd, ftype=ftype, file_bytes=size, bandwidth_gbs=bandwidth, limit_b1=bandwidth * 1e9 / per_token)  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
    print()
    print(markdown(rows, args, info))


def markdown(rows: list[dict], args: argparse.Namespace, info: dict) -> str:
    gb = 1e9
    bs = args.batches
    rounds = max((r["round"] for r in rows), default=1)
    by_round = rounds > 1  # then a round column, and the median of each round's ratio
    lines = [
        f"## CPU decode at the {args.shape} shape ({gguf_shapes.SHAPES[args.shape][0]}, random weights, "
        "SmolLM2 tokenizer: speed only)",
        "",
        f"- machine: {info['cpu']}, {info['cores']} cores, {info['threads']} threads; memory "
        f"bandwidth {info['bandwidth_gbs']:.1f} GB/s at the start (each row: its own, before and after it); syshax kernels `{info.get('syshax_simd', '?')}`, "
        f"llama.cpp `{info.get('llama_cpp_cpu', '?')}`",
        f"- date: {info['date']}; prompt {args.prompt_tokens} tokens, {args.new_tokens} new tokens, greedy",
        "",
        ("| round " if by_round else "")
        + "| engine | file | file GB | load s | peak RSS GB | RSS / file | prefill tok/s | "
        + " | ".join(f"decode b={b}" for b in bs)
        + " | b=1 % of bandwidth limit (GB/s at the row) | "
        + " | ".join(f"vs llama.cpp b={b}" for b in bs)
        + " |",
        ("|---:" if by_round else "")
        + "|---|---|---:|---:|---:|---:|---:|"
        + "---:|" * (2 * len(bs) + 1),
    ]
    ref = {(r["ftype"], r["round"]): r for r in rows if r["engine"] == "llama.cpp"}
    ratios: dict[tuple[str, int], list[float]] = {}
    for r in rows:
        dec = {int(k): v for k, v in r["decode_tps"].items()}
        base = {
            int(k): v
            for k, v in ref.get((r["ftype"], r["round"]), {}).get("decode_tps", {}).items()
        }
        for b in bs:
            if r["engine"] != "llama.cpp" and b in base and b in dec:
                ratios.setdefault((r["ftype"], b), []).append(dec[b] / base[b])
        cells = [
            *([str(r["round"])] if by_round else []),
            r["engine"],
            r["ftype"],
            f"{r['file_bytes'] / gb:.2f}",
            f"{r['load_s']:.2f}",
            f"{r['peak_rss'] / gb:.2f}",
            f"{r['peak_rss'] / r['file_bytes']:.2f}",
            f"{r['prefill_tps']:.1f}",
            *(f"{dec.get(b, 0):.1f}" for b in bs),
            f"{100 * dec.get(1, 0) / r['limit_b1']:.0f}% ({r['bandwidth_gbs']:.1f})",
            *(
                f"{dec[b] / base[b]:.2f}"
                if r["engine"] != "llama.cpp" and b in base and b in dec
                else "-"
                for b in bs
            ),  # fmt: skip
        ]
        lines.append("| " + " | ".join(cells) + " |")
    if by_round:  # each round's ratio is ours against the llama.cpp run right after it
        lines += ["", f"Ours / llama.cpp, median over {rounds} rounds (lowest - highest):", ""]
        for (ftype, b), rs in ratios.items():
            lines.append(
                f"- {ftype} b={b}: **{statistics.median(rs):.2f}x** ({min(rs):.2f} - {max(rs):.2f})"
            )
    return "\n".join(lines)


def parse_child(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--child", required=True)
    p.add_argument("--child-model", required=True)
    p.add_argument("--threads", type=int)
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--new-tokens", type=int)
    p.add_argument("--prompt-tokens", type=int)
    p.add_argument("--repeats", type=int)
    p.add_argument("--verbose", action="store_true")
    return p.parse_args(argv)


if __name__ == "__main__":
    child(parse_child(sys.argv[1:]))
