"""CPU decode speed per weight format: our PyTorch and fused paths vs llama.cpp, in one run.

For each format in --formats the bundled model (SmolLM2-135M-Instruct, Q4_1) is converted once
with bench/gguf_convert.py (cached) and measured by:

* syshax torch: Engine(quantize=<format>, op_mode=None), the PyTorch step with the native GEMM;
* syshax fused: Engine(quantize=<format>, op_mode="fused"), the whole step in one native call;
* llama.cpp: the same converted file, the same thread count, batched decode with one seq_id
  per sequence (bench/engine.py's bench_llama).

Format f32: ours loads the bundled Q4_1 file dequantized to float32 (quantize=None); llama.cpp
gets an F32 conversion of it (same values, same bytes per token; --llama-float F16 for F16).
transformers (fp32, bundled file, --transformers-batches) is measured once at the end.

Every engine gets the same token ids (bench/engine.py's make_prompts). Prefill tok/s: one
--prompt-tokens prompt, median of --repeats after a warm-up (wall time). Decode tok/s: greedy,
EOS ignored, B sequences decoding together, tokens of all sequences / decode seconds, after a
warm-up at the same B; ours from engine.stats deltas (decode steps only, prefill excluded).
Engines load one after another, each dropped and gc'd before the next.

Bandwidth limit: GB/s of torch x.sum() over a --bandwidth-mb float32 buffer (best of 10, with
--threads threads) divided by the bytes one decode step reads at batch 1: every projection
matrix and the LM head in the format, plus one float32 embedding row (norms left out).

    python bench/cpu_decode.py                      # full run (tens of minutes on 2 cores)
    python bench/cpu_decode.py --batches 1,2 --new-tokens 8 --prompt-tokens 16 \\
        --formats q4_0 --skip transformers          # smoke run

llama.cpp needs `pip install llama-cpp-python==0.3.36`; without it its rows are skipped.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
import engine as engine_bench  # noqa: E402
import gguf_convert  # noqa: E402
from syshax.shared.default_model import default_model_path  # noqa: E402
from syshax.shared.gguf_reader import read_gguf_info

# format -> (GGUF type of the converted file, Engine quantize=, bytes per weight)
FORMATS: dict[str, tuple[str | None, str | None, float]] = {
    "q4_0": ("Q4_0", "q4_0", 18 / 32),
    "q8_0": ("Q8_0", "q8_0", 34 / 32),
    "f32": (None, None, 4.0),
    # The file's own blocks, whatever they are (the CPU default for a GGUF): --shape runs
    "stored": (None, "stored", 0.0),
}
ENGINES = {"torch", "fused", "llama.cpp", "transformers"}
ALIASES = {"llama": "llama.cpp", "llamacpp": "llama.cpp", "tf": "transformers", "pytorch": "torch"}  # fmt: skip


@dataclass
class DecodeRow(engine_bench.Row):
    fmt: str = ""  # q4_0 | q8_0 | f32
    mode: str = ""  # torch | fused | native (llama.cpp) | fp32 (transformers)
    weight_bytes: int | None = None  # bytes per decode step counted in the loaded engine

    @property
    def label(self) -> str:
        return f"{self.engine} {self.fmt} {self.mode}"


def engine_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights one batch-1 decode step reads: QuantLinear blocks and float Linear
    weights (each storage once) plus one embedding row."""
    from syshax.workers.cpu.quantized import QuantLinear

    seen: set[int] = set()
    total = 0
    for mod in model.modules():
        buf = mod.blocks if isinstance(mod, QuantLinear) else None
        if buf is None and isinstance(mod, torch.nn.Linear):
            buf = mod.weight
        if buf is not None and buf.data_ptr() not in seen:
            seen.add(buf.data_ptr())
            total += buf.numel() * buf.element_size()
    from syshax.workers.cpu.quantized import QuantEmbedding

    emb = model.embed_tokens
    if isinstance(emb, QuantEmbedding):  # one row of the stored table
        return total + emb.table.shape[1]
    return total + emb.weight.shape[1] * emb.weight.element_size()


def gguf_weight_bytes(path: Path, fmt: str) -> int:
    """The same count from the GGUF's tensor shapes: blk.* matrices + LM head in `fmt` +
    one float32 embedding row."""
    per = FORMATS[fmt][2]
    tensors = {t.name: t.dims for t in read_gguf_info(path).tensors}
    numel = lambda dims: int(torch.tensor(dims).prod())  # noqa: E731
    mats = sum(numel(d) for n, d in tensors.items() if n.startswith("blk.") and len(d) == 2)
    head = tensors.get("output.weight", tensors["token_embd.weight"])
    return int((mats + numel(head)) * per) + tensors["token_embd.weight"][0] * 4


def bench_ours(args: argparse.Namespace, path: Path, prompts: list[list[int]], fmt: str, mode: str) -> DecodeRow:  # fmt: skip
    """bench/engine.py's bench_ours with quantize/op_mode, and decode timed by engine.stats."""
    from syshax.shared.sampling import SamplingParams
    from syshax.workers.engine.engine import Engine

    quantize = FORMATS[fmt][1]
    start = time.perf_counter()
    # No prefix caching (the timed prompts repeat: it would skip their prefill) and a token
    # budget that prefills every prompt of a batch in one step (decode steps stay pure decode).
    budget = max(args.batches) * (args.prompt_tokens + 8)
    eng = Engine(path, max_model_len=args.prompt_tokens + args.new_tokens + 8, max_num_seqs=max(args.batches), max_num_batched_tokens=budget, prefix_caching=False, load_tokenizer=False, progress=False, quantize=quantize, op_mode="fused" if mode == "fused" else None)  # fmt: skip
    load_s = time.perf_counter() - start
    weights = f"{engine_bench.quant_name(path)} -> {quantize or 'float32'}"
    row = DecodeRow("syshax", weights, load_s=load_s, fmt=fmt, mode=mode)
    row.weight_bytes = engine_weight_bytes(eng.model)
    counter = iter(range(10**9))

    def run(batch: int, new_tokens: int) -> tuple[float, int, list[int]]:
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, seed=0)
        rids = [f"r{next(counter)}" for _ in range(batch)]
        for rid, prompt in zip(rids, prompts, strict=False):
            eng.add_request(rid, prompt, params)
        secs0, toks0, out0 = eng.stats.decode_seconds, eng.stats.decode_tokens, []
        while eng.has_unfinished():
            out0 += [o.token_id for o in eng.step() if o.request_id == rids[0]]
        return eng.stats.decode_seconds - secs0, eng.stats.decode_tokens - toks0, out0

    return engine_bench.measure(row, args, lambda: run(1, 1), run)


def bench_llama(args: argparse.Namespace, path: Path, prompts: list[list[int]], fmt: str, threads: int) -> DecodeRow:  # fmt: skip
    r = engine_bench.bench_llama(args, path, prompts, threads)
    r.weights = r.weights.replace("ALL_F32", "F32")
    return DecodeRow(**asdict(r), fmt=fmt, mode="native")


def bench_transformers(args: argparse.Namespace, path: Path, prompts: list[list[int]]) -> DecodeRow:  # fmt: skip
    targs = argparse.Namespace(**{**vars(args), "batches": args.transformers_batches})
    r = engine_bench.bench_transformers(targs, path, prompts, "float32")
    return DecodeRow(**asdict(r), fmt="f32", mode="fp32")


def simd_info() -> dict[str, str]:
    """Which instruction sets each engine was built for: a fair comparison needs both."""
    from syshax.shared import env
    from syshax.workers.cpu import lib

    out = {"syshax_simd": lib.load().sx_simd().decode(), "kernel_march": env.kernel_march()}
    try:
        import llama_cpp

        text = llama_cpp.llama_print_system_info().decode()
        cpu = next((part for part in text.split("CPU :")[1:2]), "").strip(" |\n")
        out["llama_cpp_cpu"] = " ".join(cpu.replace(" = 1", "").split(" | ")) or text.strip()
    except (ImportError, OSError, RuntimeError, AttributeError):  # not installed, or no libraries
        pass
    return out


def bandwidth_gbs(mb: int, repeats: int = 10) -> float:
    """Read bandwidth: best time of torch sum() over an `mb` MiB float32 buffer."""
    x = torch.ones(mb * 2**20 // 4)
    x.sum()  # first touch and warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best / 1e9


def warm_process(src: Path) -> None:
    """One-time process costs kept out of the first row's load time: the native kernel build
    (once per source change), torch's lazy imports and the allocator's first large pages
    (a throwaway float load of `src`, ~2 s more on the first load otherwise)."""
    from syshax.workers.engine.engine import Engine

    try:
        from syshax.workers.cpu import lib

        lib.load()
    except Exception as exc:  # the rows then fail one by one and say why
        print(f"# CPU kernels unavailable: {exc}", file=sys.stderr)
    Engine(src, max_model_len=64, max_num_seqs=1, load_tokenizer=False, progress=False)
    gc.collect()


# ---- output --------------------------------------------------------------------------------


def num(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def print_row(row: DecodeRow, limit: float | None) -> None:
    """A `vllm bench`-style block for one measured row."""
    width = 52
    print(f" {row.label} ".center(width, "="))
    lines: list[tuple[str, str]] = [("Weights:", row.weights), ("Load time (s):", num(row.load_s, 2))]  # fmt: skip
    lines.append(("Prefill throughput (tok/s):", num(row.prefill_tps)))
    for b, tps in row.decode_tps.items():
        lines.append((f"Decode throughput, batch {b} (tok/s):", num(tps)))
    if limit and 1 in row.decode_tps:
        lines.append(("Batch 1 vs bandwidth limit (%):", num(100 * row.decode_tps[1] / limit)))
    for k, v in lines:
        print(f"{k:<40}{v:>12}")
    print("=" * width, flush=True)


def ratios(rows: list[DecodeRow], batches: list[int]) -> dict[str, dict[int, float]]:
    """For each fused row: its decode tok/s / llama.cpp's on the same format, at each batch."""
    llama = {r.fmt: r for r in rows if r.engine == "llama.cpp"}
    out: dict[str, dict[int, float]] = {}
    for r in rows:
        ref = llama.get(r.fmt)
        if r.mode == "fused" and ref is not None:
            out[r.label] = {b: r.decode_tps[b] / ref.decode_tps[b] for b in batches if b in r.decode_tps and b in ref.decode_tps}  # fmt: skip
    return out


def agreements(rows: list[DecodeRow]) -> list[str]:
    """Leading greedy batch-1 tokens shared by each pair of rows of one format."""
    lines = []
    for fmt in dict.fromkeys(r.fmt for r in rows):
        same = [r for r in rows if r.fmt == fmt and r.tokens_b1]
        for i, a in enumerate(same):
            for b in same[i + 1 :]:
                agree = engine_bench.agreement(a.tokens_b1, b.tokens_b1)
                lines.append(f"- {fmt}: {a.engine} {a.mode} vs {b.engine} {b.mode}: {agree}")
    return lines


def markdown(rows: list[DecodeRow], args: argparse.Namespace, info: dict[str, Any]) -> str:
    bs = sorted({b for r in rows for b in r.decode_tps} | set(args.batches))
    ends = sorted({min(args.batches), max(args.batches)})  # b=1 and b=16 by default
    rat = ratios(rows, ends)
    lines = [
        f"## CPU decode: {info['model']}",
        "",
        f"- machine: {info['cpu']}, {info['cores']} cores, {info['threads']} threads (torch and "
        f"llama.cpp), torch {info['torch']}, python {info['python']}",
        f"- date: {info['date']}",
        f"- command: `{info['command']}`",
        f"- prompt {args.prompt_tokens} tokens; {args.new_tokens} new tokens per sequence, greedy, "
        "EOS ignored; decode tok/s = all sequences' decode tokens / decode seconds",
        f"- memory bandwidth (torch sum over {args.bandwidth_mb} MiB, best of 10): "
        f"{info['bandwidth_gbs']:.1f} GB/s",
        f"- instruction sets: syshax kernels `{info.get('syshax_simd', '?')}` "
        f"(SYSHAX_KERNEL_MARCH={info.get('kernel_march', '?')}); "
        f"llama.cpp `{info.get('llama_cpp_cpu', 'not measured')}`",
        "",
        "| engine | format | mode | weights | load s | prefill tok/s | "
        + " | ".join(f"decode b={b}" for b in bs)
        + "".join(f" | vs llama.cpp b={b}" for b in ends)
        + " |",
        "|---|---|---|---|---:|---:|" + "---:|" * (len(bs) + len(ends)),
    ]
    for r in rows:
        cells = [num(r.load_s, 2), num(r.prefill_tps), *(num(r.decode_tps.get(b)) for b in bs)]
        ratio = rat.get(r.label, {})
        cells += [num(ratio.get(b), 2) for b in ends]
        lines.append(f"| {r.engine} | {r.fmt} | {r.mode} | {r.weights} | " + " | ".join(cells) + " |")  # fmt: skip
    lines += [
        "",
        "| format | MB read per token | limit b=1 tok/s | best ours b=1 | llama.cpp b=1 |",
    ]
    lines.append("|---|---:|---:|---:|---:|")
    for fmt, lim in info["limits"].items():
        ours = [r.decode_tps.get(1) for r in rows if r.fmt == fmt and r.engine == "syshax"]
        ours_b1 = max((v for v in ours if v), default=None)
        ll = next((r.decode_tps.get(1) for r in rows if r.fmt == fmt and r.engine == "llama.cpp"), None)  # fmt: skip
        pct = lambda v, t=lim["tok_s"]: "-" if v is None else f"{v:.1f} ({100 * v / t:.0f}%)"  # noqa: E731
        lines.append(f"| {fmt} | {lim['bytes'] / 1e6:.1f} | {lim['tok_s']:.1f} | {pct(ours_b1)} | {pct(ll)} |")  # fmt: skip
    agree = info["agreement"] or ["- nothing to compare (one row per format)"]
    lines += ["", "Greedy token agreement at batch 1 (leading tokens equal / compared):", *agree]
    lines += [f"\nSkipped {s}" for s in info["skipped"]]
    return "\n".join(lines)


def plot(rows: list[DecodeRow], info: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("# --plot: matplotlib is not installed (pip install matplotlib); no plot", file=sys.stderr)  # fmt: skip
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    colors = {}
    for r in rows:
        bs = sorted(r.decode_tps)
        (line,) = ax.plot(bs, [r.decode_tps[b] for b in bs], marker="o", label=r.label)
        colors.setdefault(r.fmt, line.get_color())
    for fmt, lim in info["limits"].items():
        ax.axhline(lim["tok_s"], color=colors.get(fmt, "gray"), ls="--", lw=1)
        ax.annotate(f"{fmt} bandwidth limit at b=1: {lim['tok_s']:.0f} tok/s", (1, lim["tok_s"]), fontsize=8, va="bottom")  # fmt: skip
    ax.set_xscale("log", base=2)
    ticks = sorted({b for r in rows for b in r.decode_tps})
    ax.set_xticks(ticks, [str(b) for b in ticks])
    ax.set_xlabel("decode batch size")
    ax.set_ylabel("decode tok/s (all sequences)")
    ax.set_title(f"{info['model']}, {info['threads']} threads, {info['cpu']}", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"# plot written to {path}", file=sys.stderr)


# ---- main ----------------------------------------------------------------------------------


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _names(s: str) -> list[str]:
    return [x.strip().lower() for x in s.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add = p.add_argument
    add("--model", type=Path, help="source GGUF that every format is converted from (default: the bundled SmolLM2-135M-Instruct Q4_1)")  # fmt: skip
    add("--formats", type=_names, default=["q4_0", "q8_0", "f32"], help="weight formats, comma-separated: q4_0,q8_0,f32 (default all three)")  # fmt: skip
    add("--batches", type=_ints, default=[1, 4, 8, 16], help="decode batch sizes for ours and llama.cpp (default 1,4,8,16)")  # fmt: skip
    add("--transformers-batches", type=_ints, default=[1, 8], help="decode batch sizes for transformers, which is slow (default 1,8)")  # fmt: skip
    add("--new-tokens", type=int, default=64, help="new tokens per sequence in each decode run, >= 2 (default 64)")  # fmt: skip
    add("--prompt-tokens", type=int, default=128, help="prompt length in tokens, the same ids for every engine (default 128)")  # fmt: skip
    add("--threads", type=int, help="threads for torch, our kernels, llama.cpp and the bandwidth probe (default: torch.get_num_threads())")  # fmt: skip
    add("--repeats", type=int, default=5, help="timed prefill runs after one warm-up; the median is reported (default 5)")  # fmt: skip
    add("--skip", type=_names, default=[], help="rows to leave out, comma-separated: torch, fused, llama.cpp (or llama), transformers")  # fmt: skip
    add("--llama-float", choices=["F32", "F16"], default="F32", help="GGUF type llama.cpp gets for the f32 format (default F32: the same bytes per token as ours)")  # fmt: skip
    add("--bandwidth-mb", type=int, default=512, help="buffer size of the bandwidth probe in MiB, >> L3 (default 512)")  # fmt: skip
    add("--cache-dir", type=Path, default=gguf_convert.DEFAULT_CACHE, help=f"where converted GGUF files are kept (default {gguf_convert.DEFAULT_CACHE})")  # fmt: skip
    add("--json", type=Path, help="write every figure (machine, arguments, bandwidth, limits, rows) to this JSON file")  # fmt: skip
    add("--plot", type=Path, help="draw decode tok/s vs batch for every row plus the bandwidth limits to this PNG (needs matplotlib)")  # fmt: skip
    add("--verbose", action="store_true", help="show llama.cpp's log and transformers' progress bars")  # fmt: skip
    add("--shape", choices=["1b", "3b", "8b", "qwen7b"], help="instead of SmolLM2: a random-weight GGUF of a public model's shape (bench/gguf_shapes.py), ours vs llama.cpp, each in its own process (load time, peak RSS, prefill, decode)")  # fmt: skip
    add("--rounds", type=int, default=1, help="--shape: run the engines this many times each, alternating, and report every round's ratios and their median (a VM's bandwidth drifts by 2x within minutes; default 1)")  # fmt: skip
    add("--shape-types", type=lambda s: [x.strip().upper() for x in s.split(",")], default=["Q4_0", "Q8_0", "Q4_K_M"], help="llama.cpp quantizations for --shape (default Q4_0,Q8_0,Q4_K_M)")  # fmt: skip
    args = p.parse_args(argv)
    args.skip = [ALIASES.get(s, s) for s in args.skip]
    if args.rounds < 1:
        p.error("need --rounds >= 1")
    if args.new_tokens < 2 or args.prompt_tokens < 1 or min(args.batches + args.transformers_batches, default=0) < 1:  # fmt: skip
        p.error("need --new-tokens >= 2, --prompt-tokens >= 1 and batch sizes >= 1")
    if unknown := set(args.skip) - ENGINES:
        p.error(f"--skip: unknown {sorted(unknown)}; known: {sorted(ENGINES)}")
    known = [f for f in FORMATS if f != "stored"]  # "stored": the --shape runs only
    if unknown := set(args.formats) - set(known):
        p.error(f"--formats: unknown {sorted(unknown)}; known: {', '.join(known)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.shape:
        import cpu_shapes

        if args.batches == [1, 4, 8, 16]:
            args.batches = [1, 4, 16]
        cpu_shapes.run(args)
        return
    src = args.model or default_model_path()
    want = "transformers" not in args.skip
    pargs = argparse.Namespace(**{**vars(args), "batches": args.batches + (args.transformers_batches if want else [])})  # fmt: skip
    threads, prompts, info = engine_bench.setup(args, src, pargs)
    info["bandwidth_gbs"] = bandwidth_gbs(args.bandwidth_mb)
    print(f"# memory bandwidth: {info['bandwidth_gbs']:.1f} GB/s ({threads} threads)", flush=True)
    if "llama.cpp" not in args.skip and not engine_bench.llama_importable(info):
        args.skip.append("llama.cpp")
    info.update(simd_info())
    jobs: list[tuple[str, str, Callable[[], DecodeRow]]] = []
    info["limits"] = {}
    for fmt in args.formats:
        gtype = FORMATS[fmt][0]
        ours_path = gguf_convert.cached(src, gtype, args.cache_dir) if gtype else src
        nbytes = gguf_weight_bytes(ours_path, fmt)
        info["limits"][fmt] = {"bytes": nbytes, "tok_s": info["bandwidth_gbs"] * 1e9 / nbytes}
        for mode in ("torch", "fused"):
            if mode not in args.skip:
                jobs.append((fmt, f"syshax {fmt} {mode}", lambda p=ours_path, f=fmt, m=mode: bench_ours(args, p, prompts, f, m)))  # fmt: skip
        if "llama.cpp" not in args.skip:
            ll_path = gguf_convert.cached(src, gtype or args.llama_float, args.cache_dir)
            jobs.append((fmt, f"llama.cpp {fmt}", lambda p=ll_path, f=fmt: bench_llama(args, p, prompts, f, threads)))  # fmt: skip
    if want:
        jobs.append(("f32", "transformers fp32", lambda: bench_transformers(args, src, prompts)))
    if {"torch", "fused"} - set(args.skip):
        print("# warm-up: kernel build check and one throwaway load", file=sys.stderr, flush=True)
        warm_process(src)
    rows: list[DecodeRow] = []
    for fmt, name, job in jobs:
        print(f"# running {name} ...", file=sys.stderr, flush=True)
        try:
            row = job()
        except Exception as exc:  # one broken engine must not lose the others' rows
            info["skipped"].append(f"{name}: it failed with {type(exc).__name__}: {exc}")
            print(f"# {name} failed: {exc}", file=sys.stderr)
        else:
            rows.append(row)
            lim = info["limits"].get(fmt)
            if row.weight_bytes and lim and abs(row.weight_bytes / lim["bytes"] - 1) > 0.01:
                print(f"# {name}: engine reads {row.weight_bytes} B/token, GGUF count {lim['bytes']}", file=sys.stderr)  # fmt: skip
            print_row(row, lim["tok_s"] if lim and row.engine != "transformers" else None)
        gc.collect()  # the engine's closures die here: free its weights before the next loads
    info["agreement"] = agreements(rows)
    info["ratios_vs_llama"] = ratios(rows, sorted(set(args.batches)))
    print()
    print(markdown(rows, args, info))
    if args.json:
        jargs = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        doc = {"machine": info, "args": jargs, "rows": [asdict(r) for r in rows]}
        args.json.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    if args.plot:
        plot(rows, info, args.plot)


if __name__ == "__main__":
    main()
