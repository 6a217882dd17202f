"""Where a fused decode step's time goes: per op class, bytes streamed, time, GB/s, share.

Loads a GGUF as a CPU decode worker would (the native blocks, the fused step), with the kernels
built as the "profile" variant (build.py: native plus -DSX_PROFILE, prof.h): every thread adds
the TSC ticks of each op class of sx_step (the norms and activation quantization, each
projection's GEMV, attention, the LM head, the wait at each barrier) to its own counters. One
sequence (or --batch sequences) is prefilled to --context tokens, then --steps decode steps are
timed; the step's wall time around `engine.step()` gives the share of Python and the engine
around the native call. Bytes per op are the packed weights it reads (each matrix once per step).

    python bench/step_profile.py --shape 1b --type Q4_0 --steps 200
    python bench/step_profile.py --model FILE.gguf --variant native   # no clocks: for perf record

`--variant native` runs the engine's own build (no clocks), e.g. under `perf record -p PID`.
The clocks cost two TSC reads per op class per layer (~40 ns of a ~20 ms step).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gguf_shapes  # noqa: E402

# prof.h's op classes, in order; (label, weight matrix the class streams or None)
CLASSES = [
    ("attn norm + act quant", None), ("qkv GEMV", "qkv"), ("wait after qkv", None),
    ("attention (rope, KV store, attend)", None), ("wait after attention", None),
    ("o act quant", None), ("o GEMV + residual", "o"), ("wait after o", None),
    ("ffn norm + act quant", None), ("gate/up GEMV + silu (+ down act quant)", "gate_up"), ("wait after gate/up", None),
    ("down act quant (F32/F16 down only)", None), ("down GEMV + residual", "down"), ("wait after down", None),
    ("final norm + act quant", None), ("LM head GEMV", "lm_head"), ("wait at the region's end", None),
]  # fmt: skip
# barrier to barrier: (prep, work, wait) per projection, (work, wait) for attention
PHASES = [[0, 1, 2], [3, 4], [5, 6, 7], [8, 9, 10], [11, 12, 13], [14, 15, 16]]
TOTAL, STEPS, N = len(CLASSES), len(CLASSES) + 1, len(CLASSES) + 2


def mat_bytes(mat) -> int:
    """Packed bytes of a matrix descriptor (a stack: its parts')."""
    from syshax.workers.cpu import lib

    if mat.n_parts:
        parts = ctypes.cast(mat.parts, ctypes.POINTER(lib.SxMat))
        return sum(mat_bytes(parts[i]) for i in range(mat.n_parts))
    if mat.type == lib.F32:
        return mat.rows * mat.cols * 4
    return lib.packed_bytes(mat.type, mat.rows, mat.cols)


def mat_types(mat) -> str:
    from syshax.workers.cpu import lib

    if mat.n_parts:
        parts = ctypes.cast(mat.parts, ctypes.POINTER(lib.SxMat))
        return "+".join(sorted({mat_types(parts[i]) for i in range(mat.n_parts)}))
    return lib.type_name(mat.type)


def weight_bytes(desc) -> dict[str, tuple[int, str]]:
    """Per streamed class: (bytes per step over all layers, weight types)."""
    out: dict[str, tuple[int, set[str]]] = {}
    for i in range(desc.n_layers):
        layer = desc.layers[i]
        for name in ("qkv", "o", "gate_up", "down"):
            mat = getattr(layer, name)
            b, t = out.get(name, (0, set()))
            out[name] = (b + mat_bytes(mat), t | set(mat_types(mat).split("+")))
    out["lm_head"] = (mat_bytes(desc.lm_head), {mat_types(desc.lm_head)})
    return {k: (b, "+".join(sorted(t))) for k, (b, t) in out.items()}


def hand_built(path: Path) -> ctypes.CDLL:
    """A kernels library built by hand (an A/B of two builds), typed as lib.load types one."""
    from syshax.workers.cpu import lib

    so = ctypes.CDLL(str(path))
    for name, (restype, argtypes) in lib._SIGNATURES.items():
        fn = getattr(so, name)
        fn.restype, fn.argtypes = restype, argtypes
    return so


def route_native_calls(variant: str) -> None:
    """Every kernel call an engine makes for the "native" build goes to `variant` instead
    ("profile": the build with the per-op clocks; "native": no change)."""
    from syshax.workers.cpu import lib

    if variant != "native":
        plain = lib.load
        lib.load = lambda v="native": plain(variant if v == "native" else v)


def profile(args: argparse.Namespace) -> dict:
    import torch
    from syshax.shared.sampling import SamplingParams
    from syshax.workers.cpu import lib
    from syshax.workers.cpu.options import from_env, pin_threads
    from syshax.workers.engine.engine import Engine

    if args.lib:  # a library built by hand (an A/B of two builds): every kernel call goes there
        so = hand_built(args.lib)
        lib.load = lambda variant="native": so
    else:
        route_native_calls(args.variant)
    torch.set_num_threads(args.threads)
    path = str(args.model or gguf_shapes.shaped(args.shape, args.type))
    opts = from_env(args.threads).resolved(path, "cpu")  # the CPU worker's default rule
    if opts.cpus:
        pin_threads(opts)
    eng = Engine(path, device="cpu", max_model_len=args.context + args.steps + args.warmup + 16, max_num_seqs=args.batch, max_num_batched_tokens=max(256, args.batch * (args.context + 8)), prefix_caching=False, progress=False, load_tokenizer=False, kv_dtype=args.kv, **opts.engine_kwargs())  # fmt: skip
    fused = eng.fused
    if fused is None:
        raise SystemExit("the engine did not build the fused step (INFERENCE_OP_MODE=none?)")
    rng = random.Random(0)
    params = SamplingParams(max_tokens=args.steps + args.warmup + 8, temperature=0.0, ignore_eos=True, seed=0)  # fmt: skip
    for i in range(args.batch):
        eng.add_request(f"p{i}", [rng.randrange(100, 30000) for _ in range(args.context)], params)
    started: set[str] = set()
    while len(started) < args.batch:
        started |= {o.request_id for o in eng.step()}
    for _ in range(args.warmup):
        eng.step()
    nt, layers = fused.threads, fused.model_desc.n_layers + 1  # the LM head's row last
    counters = (ctypes.c_uint64 * (nt * layers * N))()
    k = fused._lib
    k.sx_prof_read(fused._ctx, counters, 1)
    walls, rows = [], []
    tsc0, t0 = k.sx_prof_tsc(), time.perf_counter()
    for _ in range(args.steps):
        s = time.perf_counter()
        eng.step()
        walls.append(time.perf_counter() - s)
        if k.sx_prof_read(fused._ctx, counters, 1) >= 0:  # this step's ticks, then zeroed
            rows.append(list(counters))
    tsc1, t1 = k.sx_prof_tsc(), time.perf_counter()
    result = {"model": path, "threads": nt, "batch": args.batch, "context": args.context, "steps": args.steps, "variant": str(args.lib or args.variant), "simd": k.sx_simd().decode(), "wall_ms": [w * 1e3 for w in walls]}  # fmt: skip
    result["bytes"] = weight_bytes(fused.model_desc)
    if rows:  # ms[step][thread][layer][class]; the sx_step call's ms per step
        hz = (tsc1 - tsc0) / (t1 - t0)
        result["tsc_hz"] = hz
        at = lambda t, y, c: (t * layers + y) * N + c  # noqa: E731
        result["ms"] = [[[[row[at(t, y, c)] / hz * 1e3 for c in range(len(CLASSES))] for y in range(layers)] for t in range(nt)] for row in rows]  # fmt: skip
        result["native_ms"] = [row[at(0, layers - 1, TOTAL)] / hz * 1e3 for row in rows]
    return result


def report(r: dict, quiet: float) -> str:
    """Two views of a loaded machine's steps. "quiet": the breakdown averaged over the quietest
    `quiet` fraction of steps (lowest wall time). "best": for every layer, op class and thread
    the least time any step took, summed over the layers: preemption and other processes'
    memory traffic only ever add time, so this is what the step costs undisturbed (a lower
    bound: no one step need have been that fast everywhere)."""
    walls = r["wall_ms"]
    order = sorted(range(len(walls)), key=walls.__getitem__)
    keep = order[: max(1, int(len(order) * quiet))]
    wall = sum(walls[i] for i in keep) / len(keep)
    median = walls[order[len(order) // 2]]
    total_b = sum(b for b, _ in r["bytes"].values())
    lines = [f"# {r['model']}: {r['threads']} threads, batch {r['batch']}, context {r['context']}, {r['steps']} steps, {r['simd']}"]  # fmt: skip
    lines.append(f"# engine.step(): median {median:.2f} ms ({1e3 / median:.1f} tok/s), min {walls[order[0]]:.2f} ms; the quietest {len(keep)} steps: mean {wall:.2f} ms ({1e3 / wall:.1f} tok/s)")  # fmt: skip
    lines.append(f"# weights streamed per step: {total_b / 1e6:.1f} MB -> {total_b / wall / 1e6:.1f} GB/s over the quietest steps, {total_b / median / 1e6:.1f} over the median step")  # fmt: skip
    if "ms" not in r:
        return "\n".join(lines)
    ms, nt = r["ms"], r["threads"]
    layers = len(ms[0][0])
    quiet_ms = [[sum(sum(ms[i][t][y][c] for y in range(layers)) for i in keep) / len(keep) for c in range(len(CLASSES))] for t in range(nt)]  # fmt: skip
    # "best": a phase runs from one barrier to the next (each thread: its prep, its share of
    # the GEMV, its wait), and its duration is the longest of the threads' sums (a thread
    # that entered late, preempted at the barrier before, has a shorter one); per layer and
    # phase take the step where that was least, and the split of the thread that set it.
    best = [0.0] * len(CLASSES)
    for y in range(layers):
        for cls in PHASES:
            dur = lambda i, t: sum(ms[i][t][y][c] for c in cls)  # noqa: E731, B023
            i = min(range(len(ms)), key=lambda i: max(dur(i, t) for t in range(nt)))  # noqa: B023
            t = max(range(nt), key=lambda t: dur(i, t))  # noqa: B023
            for c in cls:
                best[c] += ms[i][t][y][c]
    native = sum(r["native_ms"][i] for i in keep) / len(keep)
    best_native = min(r["native_ms"])
    best_step = sum(best)
    lines.append(f"# quiet: the quietest {len(keep)} of {len(walls)} steps, ms per step for threads {' / '.join(str(t) for t in range(nt))}; best: per layer and phase (barrier to barrier) the step where it was shortest, summed ({best_step:.2f} ms per thread in all: {total_b / best_step / 1e6:.1f} GB/s)")  # fmt: skip
    lines.append("")
    lines.append("| op | weights | MB per step | quiet ms | quiet GB/s | quiet share | best ms | best GB/s | best share |")  # fmt: skip
    lines.append("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    stream = [0.0, 0.0]
    for c, (name, mat) in enumerate(CLASSES):
        q = [quiet_ms[t][c] for t in range(nt)]
        qa, ba = sum(q) / nt, best[c]
        mb = types = qg = bg = ""
        if mat:
            b, types = r["bytes"][mat]
            mb = f"{b / 1e6:.1f}"
            qg, bg = (f"{b / v / 1e6:.1f}" if v else "-" for v in (qa, ba))
            stream = [stream[0] + qa, stream[1] + ba]
        spread = " / ".join(f"{v:.3f}" for v in q)
        lines.append(f"| {name} | {types} | {mb} | {spread} | {qg} | {100 * qa / wall:.1f}% | {ba:.3f} | {bg} | {100 * ba / best_step:.1f}% |")  # fmt: skip
    outside = [native - sum(quiet_ms[t]) for t in range(nt)]
    # least over the steps of the call's time that no thread's clocks cover
    out_best = min(r["native_ms"][i] - max(sum(sum(ms[i][t][y]) for y in range(layers)) for t in range(nt)) for i in range(len(ms)))  # fmt: skip
    lines.append(f"| sx_step outside the phases (row checks, embedding rows, fork/join) | | | {' / '.join(f'{v:.3f}' for v in outside)} | | {100 * sum(outside) / nt / wall:.1f}% | {out_best:.3f} | | |")  # fmt: skip
    py = wall - native
    py_best = min(w - n for w, n in zip(walls, r["native_ms"], strict=True))
    lines.append(f"| engine.step() around sx_step (Python: scheduling, sampling, tensors) | | | {py:.3f} | | {100 * py / wall:.1f}% | {py_best:.3f} | | |")  # fmt: skip
    whole = best_step + out_best + py_best
    lines.append("")
    lines.append(f"Best step in all (phases + outside + Python): {whole:.2f} ms, {1e3 / whole:.1f} tok/s, {total_b / whole / 1e6:.1f} GB/s; the GEMVs {100 * stream[1] / whole:.1f}% of it")  # fmt: skip
    lines.append(f"GEMV classes together: quiet {stream[0]:.2f} ms per thread, {100 * stream[0] / wall:.1f}% of the step, {total_b / stream[0] / 1e6:.1f} GB/s while streaming; best {stream[1]:.2f} ms, {100 * stream[1] / best_step:.1f}%, {total_b / stream[1] / 1e6:.1f} GB/s; fastest sx_step call {best_native:.2f} ms")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", type=Path, help="a GGUF file (default: the --shape/--type random-weight file)")  # fmt: skip
    p.add_argument("--shape", choices=list(gguf_shapes.SHAPES), default="1b")
    p.add_argument("--type", default="Q4_0", choices=list(gguf_shapes.FTYPES))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=128, help="tokens prefilled before the timed steps (default 128)")  # fmt: skip
    p.add_argument("--kv", choices=["float16", "q8_0"], default="float16", help="the KV cache's type (default float16)")  # fmt: skip
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--variant", default="profile", choices=["profile", "native"], help="kernel build (default profile: with the clocks)")  # fmt: skip
    p.add_argument("--lib", type=Path, help="run this kernels library instead (built with -DSX_PROFILE for the clocks): A/B of two builds")  # fmt: skip
    p.add_argument("--quiet", type=float, default=0.2, help="report the quietest fraction of steps (default 0.2: the fastest fifth)")  # fmt: skip
    p.add_argument("--json", type=Path, help="write the raw figures here")
    args = p.parse_args(argv)
    r = profile(args)
    print(report(r, args.quiet), flush=True)
    if args.json:
        args.json.write_text(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
