"""Batch 1 at a small and a large shape, in one process, steps interleaved (issue 30 part 5).

The bar: at the 1B shape a batch-1 decode step streams at least 90% of the GB/s the same
kernels reach at the 7B shape. Run one after the other, two processes measure two different
machines on a VM whose memory bandwidth drifts: on the 2-core Zen 4 VM the same 1B Q4_0 step
profile gave 31.8 and 49.2 GB/s minutes apart (2026-12-07), more than the bar's margin. So
both models load into this one process (each as a CPU decode worker loads a GGUF: native
blocks, the fused step), one sequence each is prefilled, and the timed decode steps alternate
in short windows (--small-steps steps of the small model, then --large-steps of the large
one, ~0.15 s each). Each window pair gives both GB/s within a fraction of a second of each
other, and their ratio; the report is the distribution of those paired ratios.

Both load their weights as `syshax worker` does, onto huge pages from the first touch
(SYSHAX_HUGE_PAGES=eager unless set; on 4 KiB pages the engine loaded first streamed 5-8%
slower than the second, which made the load order part of the ratio).

GB/s of a step = the packed weights it streams (every matrix once, as bench/step_profile.py
counts them) / the fastest step of the window (preemption only ever adds time).

`--variant profile` runs the kernels built with per-op clocks (bench/step_profile.py) and adds,
per op class, the ms per step of each model over the windows, split into the windows where the
large model streamed fastest and slowest: where the small model loses its GB/s, and whether
that depends on how fast the memory is at the time.

    python bench/batch1_pair.py --type Q4_0            # 1b vs qwen7b, random-weight files
    python bench/batch1_pair.py --type Q4_K_M --windows 60
    python bench/batch1_pair.py --type Q4_0 --large-first  # the other load order (see run())

With --small-lib / --large-lib (hand-built kernel libraries) and --large 1b, the same file in
two engines, each on its own library: an A/B of two builds, paired window by window.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gguf_shapes  # noqa: E402
from step_profile import CLASSES, N, hand_built, route_native_calls, weight_bytes  # noqa: E402


class Stepper:
    """One engine with one sequence decoding, stepped one token at a time."""

    def __init__(self, path: str, threads: int, context: int, span: int) -> None:
        from syshax.shared.sampling import SamplingParams
        from syshax.workers.cpu.options import from_env
        from syshax.workers.engine.engine import Engine

        opts = from_env(threads).resolved(path, "cpu")  # the CPU worker's default rule
        self.opts = opts
        self.path = path
        self.eng = Engine(path, device="cpu", max_model_len=context + span + 16, max_num_seqs=1, max_num_batched_tokens=max(256, context + 8), prefix_caching=False, progress=False, load_tokenizer=False, **opts.engine_kwargs())  # fmt: skip
        if self.eng.fused is None:
            raise SystemExit("the engine did not build the fused step (INFERENCE_OP_MODE=none?)")
        self.bytes = sum(b for b, _ in weight_bytes(self.eng.fused.model_desc).values())
        self.rng = random.Random(0)
        self.context = context
        self.params = SamplingParams(max_tokens=span, temperature=0.0, ignore_eos=True, seed=0)
        self.served = 0
        fused = self.eng.fused
        self.layers = fused.model_desc.n_layers + 1  # the LM head's row last
        self.counters = (ctypes.c_uint64 * (fused.threads * self.layers * N))()
        self.ticks = [0] * len(self.counters)  # the timed steps' ticks since the last report
        self.profiled = fused._lib.sx_prof_read(fused._ctx, self.counters, 1) >= 0
        self._refill()

    def _drain(self, keep: bool) -> None:
        """Read (and zero) the clocks; `keep`: they count for the report (not a prefill's)."""
        if self.profiled:
            self.eng.fused._lib.sx_prof_read(self.eng.fused._ctx, self.counters, 1)
            if keep:
                self.ticks = [a + b for a, b in zip(self.ticks, self.counters, strict=True)]

    def _refill(self) -> None:
        """A new sequence, prefilled up to its first token (untimed): both models decode at
        contexts between `context` and `context + span`, whatever their step counts."""
        self._drain(keep=True)
        self.served += 1
        prompt = [self.rng.randrange(100, 30000) for _ in range(self.context)]
        self.eng.add_request(f"r{self.served}", prompt, self.params)
        while not self.eng.step():  # the prompt's chunk(s)
            pass
        self._drain(keep=False)

    def window(self, steps: int) -> float:
        """The fastest of `steps` decode steps, in seconds."""
        best = float("inf")
        for _ in range(steps):
            if not self.eng.has_unfinished():
                self._refill()
            start = time.perf_counter()
            self.eng.step()
            best = min(best, time.perf_counter() - start)
        return best

    def classes_ms(self, steps: int) -> list[float]:
        """Ticks per op class since the last read (then zeroed), as ms per step, the threads'
        mean, summed over the layers."""
        fused = self.eng.fused
        k, nt = fused._lib, fused.threads
        t0, c0 = time.perf_counter(), k.sx_prof_tsc()
        time.sleep(0.002)
        hz = (k.sx_prof_tsc() - c0) / (time.perf_counter() - t0)
        self._drain(keep=True)
        ticks, self.ticks = self.ticks, [0] * len(self.counters)
        at = lambda t, y, c: (t * self.layers + y) * N + c  # noqa: E731
        return [sum(ticks[at(t, y, c)] for t in range(nt) for y in range(self.layers)) / nt / hz * 1e3 / steps for c in range(len(CLASSES))]  # fmt: skip


def run(args: argparse.Namespace) -> dict:
    import torch
    from syshax.workers.cpu import lib
    from syshax.workers.cpu.options import pin_threads

    route_native_calls(args.variant)  # both engines (profile: the build with the clocks)
    default_load = lib.load

    def engine_on(so_path: Path | None, path: str) -> Stepper:
        """A Stepper whose fused step runs `so_path` (a hand-built library) if given."""
        if so_path is not None:
            so = hand_built(so_path)
            lib.load = lambda variant="native": so
        try:
            return Stepper(path, args.threads, args.context, args.span)
        finally:
            lib.load = default_load

    torch.set_num_threads(args.threads)
    small_path = str(args.small_model or gguf_shapes.shaped(args.small, args.type))
    large_path = str(args.large_model or gguf_shapes.shaped(args.large, args.type))
    # Which engine loads first matters on a VM: the same file and library loaded twice into one
    # process streamed 5-8% slower in the engine loaded first (2-core Zen 4 VM, 2026-12-07,
    # three runs); --large-first swaps the order, and a fair ratio takes both.
    if args.large_first:
        large = engine_on(args.large_lib, large_path)
        small = engine_on(args.small_lib, small_path)
    else:
        small = engine_on(args.small_lib, small_path)
        large = engine_on(args.large_lib, large_path)
    if small.opts.cpus:
        pin_threads(small.opts)
    small.window(args.warmup)
    large.window(args.warmup)
    pairs = []
    for i in range(args.windows):
        # alternate which model goes first, so a drift inside a pair favours neither
        order = (small, large) if i % 2 == 0 else (large, small)
        secs = {id(s): s.window(args.small_steps if s is small else args.large_steps) for s in order}  # fmt: skip
        gs, gl = small.bytes / secs[id(small)] / 1e9, large.bytes / secs[id(large)] / 1e9
        pairs.append({"small_gbs": gs, "large_gbs": gl, "ratio": gs / gl})
        if small.profiled:
            pairs[-1]["small_ms"] = small.classes_ms(args.small_steps)
            pairs[-1]["large_ms"] = large.classes_ms(args.large_steps)
        if args.verbose:
            print(f"# window {i}: {gs:.1f} / {gl:.1f} GB/s = {gs / gl:.3f}", file=sys.stderr)
    return {"small": small_path, "large": large_path, "large_first": args.large_first, "type": args.type, "threads": args.threads, "small_mb": small.bytes / 1e6, "large_mb": large.bytes / 1e6, "bytes": {"small": weight_bytes(small.eng.fused.model_desc), "large": weight_bytes(large.eng.fused.model_desc)}, "pairs": pairs}  # fmt: skip


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return q[0], statistics.median(xs), q[2]


def report(r: dict, bar: float) -> str:
    ratios = [p["ratio"] for p in r["pairs"]]
    small = [p["small_gbs"] for p in r["pairs"]]
    large = [p["large_gbs"] for p in r["pairs"]]
    q = quartiles(ratios)
    met = sum(x >= bar for x in ratios)
    lines = [
        f"# {Path(r['small']).name} ({r['small_mb']:.0f} MB a step) vs {Path(r['large']).name} ({r['large_mb']:.0f} MB), {r['threads']} threads, {len(ratios)} window pairs, {'large' if r['large_first'] else 'small'} model loaded first",  # fmt: skip
        f"small GB/s: min {min(small):.1f}, median {statistics.median(small):.1f}, max {max(small):.1f}",  # fmt: skip
        f"large GB/s: min {min(large):.1f}, median {statistics.median(large):.1f}, max {max(large):.1f}",  # fmt: skip
        f"paired ratio small / large: median {q[1]:.3f} (quartiles {q[0]:.3f} - {q[2]:.3f}); {met} of {len(ratios)} pairs >= {bar}",  # fmt: skip
    ]
    if "small_ms" in r["pairs"][0]:
        lines += ["", *breakdown(r)]
    return "\n".join(lines)


def breakdown(r: dict) -> list[str]:
    """Per op class, ms per step (and GB/s for the GEMVs) of both models, in the half of the
    windows where the large model streamed fastest and in the other half."""
    pairs = sorted(r["pairs"], key=lambda p: p["large_gbs"])
    halves = (("slow memory", pairs[: len(pairs) // 2]), ("fast memory", pairs[len(pairs) // 2 :]))
    head = (
        "| op | "
        + " | ".join(f"{name}: small ms (GB/s) | large ms (GB/s)" for name, _ in halves)
        + " |"
    )
    lines = [head, "|---|" + "---:|---:|" * len(halves)]
    for c, (label, mat) in enumerate(CLASSES):
        cells = []
        for _, half in halves:
            for side in ("small", "large"):
                ms = statistics.median(p[f"{side}_ms"][c] for p in half)
                gbs = f" ({r['bytes'][side][mat][0] / ms / 1e6:.1f})" if mat and ms > 0 else ""
                cells.append(f"{ms:.3f}{gbs}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    for name, half in halves:
        gl = statistics.median(p["large_gbs"] for p in half)
        rq = statistics.median(p["ratio"] for p in half)
        lines.append(f"{name}: large model {gl:.1f} GB/s in median, paired ratio {rq:.3f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--type", default="Q4_0", choices=list(gguf_shapes.FTYPES), help="quantization of both random-weight files (default Q4_0)")  # fmt: skip
    p.add_argument("--small", default="1b", choices=list(gguf_shapes.SHAPES), help="the small shape (default 1b)")  # fmt: skip
    p.add_argument("--large", default="qwen7b", choices=list(gguf_shapes.SHAPES), help="the large shape (default qwen7b)")  # fmt: skip
    p.add_argument("--small-model", type=Path, help="a GGUF file instead of the --small shape's")
    p.add_argument("--large-model", type=Path, help="a GGUF file instead of the --large shape's")
    p.add_argument("--small-lib", type=Path, help="a hand-built kernels library for the small model's engine")  # fmt: skip
    p.add_argument("--large-lib", type=Path, help="a hand-built kernels library for the large model's engine")  # fmt: skip
    p.add_argument("--large-first", action="store_true", help="load the large model first (default: the small one; run both: the first loaded can stream slower)")  # fmt: skip
    p.add_argument("--threads", type=int, default=2, help="kernel threads for both (default 2)")
    p.add_argument("--context", type=int, default=128, help="tokens prefilled before the timed steps (default 128)")  # fmt: skip
    p.add_argument("--span", type=int, default=64, help="decode steps per sequence; then a new one is prefilled, untimed (default 64)")  # fmt: skip
    p.add_argument("--windows", type=int, default=40, help="window pairs (default 40)")
    p.add_argument("--small-steps", type=int, default=8, help="small-model steps per window (default 8)")  # fmt: skip
    p.add_argument("--large-steps", type=int, default=2, help="large-model steps per window (default 2)")  # fmt: skip
    p.add_argument("--warmup", type=int, default=5, help="untimed steps of each model first (default 5)")  # fmt: skip
    p.add_argument("--bar", type=float, default=0.9, help="the ratio counted as met (default 0.9)")  # fmt: skip
    p.add_argument("--variant", default="native", choices=["native", "profile"], help="kernel build (default native; profile: with the per-op clocks, and a breakdown)")  # fmt: skip
    p.add_argument("--json", type=Path, help="write every window's figures here")
    p.add_argument("--verbose", action="store_true", help="print each window pair as it ends")
    args = p.parse_args(argv)
    from syshax.shared import env

    env.prefer_eager_huge_pages()  # both models load as a `syshax worker` loads its model
    if min(args.windows, args.small_steps, args.large_steps, args.warmup) < 1 or args.span < 2:
        p.error("need --windows, --small-steps, --large-steps and --warmup >= 1, --span >= 2")
    r = run(args)
    print(report(r, args.bar))
    if args.json:
        args.json.write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
