"""`syshax plan`: does CPU decode offload pay on this host, and with which CPU layout?

Predicts saturated tokens/s with the xPU alone and with CPU decode workers taking streams,
for every even split of the cores into workers (1 x N threads, 2 x N/2, ...), from an
accelerator profile (workers/accelerator_profiles.py), the model, a probe of our CPU kernels
on this machine (workers/cpu/step_probe.py; or `--cpu-step-ms` numbers) and the SLO. The
model and its assumptions: workers/capacity_plan.py; how it compares with measured runs:
docs/benchmarks.md. Light imports at module level (the parser is built for `syshax --help`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from syshax.commands.config import add_config_option


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Predict the farm's saturated output tokens/s with the xPU alone and with CPU decode "
        "offload, for each way of splitting this machine's cores into CPU decode workers, and "
        "print the best cpu.workers / cpu.threads / cpu_max_batch_size. The xPU comes from an "
        "accelerator profile scaled to the model; the CPU from a short probe of the model on "
        "this machine's cores (about 10 s per layout; the cores should be otherwise idle) or "
        "from --cpu-step-ms. Predictions, not measurements: bench/hetero.py measures."
    )
    add_config_option(p)
    p.add_argument("--profile", help="accelerator profile: a built-in name (h100, a100-40gb, a10) or a YAML/JSON file (default: the config's xpu.profile)")  # fmt: skip
    p.add_argument("--model", help="GGUF file or HF folder the CPU workers serve (default: the config's model)")  # fmt: skip
    p.add_argument("--slo-itl-ms", type=float, help="inter-token latency SLO in ms that CPU streams must keep, slow steps included (default: the config's slo.itl_ms; none = no SLO: each worker runs cpu_max_batch_size streams)")  # fmt: skip
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request (default %(default)s)")  # fmt: skip
    p.add_argument("--output-len", type=int, default=128, help="output tokens per request (default %(default)s)")  # fmt: skip
    p.add_argument("--xpu-slots", type=int, help="streams the xPU decodes at once (default: the config's xpu.max_batch_size)")  # fmt: skip
    p.add_argument("--xpu-overhead-ms", default="0", metavar="BASE[,PER_ROW]", help="the xPU worker's own cost per step outside the device (its loop, scheduling, publishing tokens): BASE + PER_ROW x streams ms; bench/hetero.py prints it as measured (default 0: none)")  # fmt: skip
    p.add_argument("--farm-tps", type=float, help="tokens/s the farm can stream at all on this host (bench/serve.py --launch echo measures it); caps the totals (default: no cap)")  # fmt: skip
    p.add_argument("--cores", type=int, help="cores for CPU decode workers (default: every core this process may use)")  # fmt: skip
    p.add_argument("--cpu-max-batch", type=int, help="most streams per CPU worker (default: the config's cpu_max_batch_size)")  # fmt: skip
    p.add_argument("--layouts", help="CPU layouts to consider, as WORKERSxTHREADS comma-separated (default: every even split of --cores)")  # fmt: skip
    p.add_argument("--cpu-step-ms", metavar="BASE,PER_ROW[,TAIL]", help="skip the probe: one CPU worker's step is BASE + PER_ROW x streams ms, slow steps TAIL x that (default tail 1); one layout (the config's cpu.workers x the CPU workers' threads: OMP_NUM_THREADS, else cpu.threads; or --layouts)")  # fmt: skip
    p.add_argument("--probe-steps", type=int, default=12, help="timed steps per batch size in the probe (default %(default)s)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the prediction as JSON instead of tables")  # fmt: skip


def _layouts(args, cfg, cores: int) -> list[tuple[int, int]]:
    from syshax.workers.capacity_plan import layouts_for

    if args.layouts:
        out = []
        for item in args.layouts.split(","):
            w, _, t = item.strip().lower().partition("x")
            if not (w.isdigit() and t.isdigit() and int(w) > 0 and int(t) > 0):
                raise ValueError(f"--layouts: {item!r} is not WORKERSxTHREADS (e.g. 2x4)")
            out.append((int(w), int(t)))
        return out
    if args.cpu_step_ms:  # the CPU workers as the config runs them (at least one)
        from syshax.workers.farm_layout import cpu_threads

        return [(cfg.cpu.workers or 1, cpu_threads(cfg))]
    return layouts_for(cores)


def _ms_numbers(text: str, flag: str, form: str, counts: tuple[int, ...]) -> list[float]:
    """Comma-separated milliseconds >= 0, as many as `counts` allows; ValueError naming `flag`."""
    try:
        parts = [float(x) for x in text.split(",")]
    except ValueError:
        parts = []
    if len(parts) not in counts or min(parts) < 0:
        raise ValueError(f"{flag} {text!r}: expected {form} in ms, >= 0")
    return parts


def _ms_pair(text: str, flag: str) -> tuple[float, float]:
    parts = _ms_numbers(text, flag, "BASE[,PER_ROW]", (1, 2))
    return parts[0], parts[1] if len(parts) == 2 else 0.0


def _given_curve(text: str):
    from syshax.workers.capacity_plan import StepCurve

    parts = _ms_numbers(text, "--cpu-step-ms", "BASE,PER_ROW[,TAIL]", (2, 3))
    if parts[0] + parts[1] <= 0:
        raise ValueError(f"--cpu-step-ms {text!r}: a step must take some time")
    return StepCurve(parts[0] / 1e3, parts[1] / 1e3, parts[2] if len(parts) == 3 else 1.0)


def probe_layout(model: str, workers: int, threads: int, batches: list[int], context: int, steps: int):  # fmt: skip
    """Run `workers` probes at once, `threads` each on their own CPUs; the slowest worker's
    fitted curve (a stream may land on any of them)."""
    from syshax.workers.capacity_plan import StepCurve

    cpus = sorted(os.sched_getaffinity(0))
    procs = []
    for i in range(workers):
        mine = cpus[i * threads : (i + 1) * threads] if len(cpus) >= workers * threads else []
        cmd = [sys.executable, "-m", "syshax.workers.cpu.step_probe", "--model", model, "--threads", str(threads), "--batches", ",".join(map(str, batches)), "--context", str(context), "--steps", str(steps), "--cpus", ",".join(map(str, mine))]  # fmt: skip
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))  # fmt: skip
    curves, kernels = [], ""
    for proc in procs:
        out, err = proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"the CPU probe failed ({workers}x{threads}): {err.strip()[-800:]}")  # fmt: skip
        data = json.loads(out.strip().splitlines()[-1])
        kernels = data["kernels"]
        medians = {int(b): statistics.median(ts) for b, ts in data["batches"].items()}
        ratios = sorted(t / medians[int(b)] for b, ts in data["batches"].items() for t in ts)
        tail = ratios[min(len(ratios) - 1, int(0.99 * len(ratios)))]
        curves.append(StepCurve.fit(medians.items(), tail=tail))
    return max(curves, key=lambda c: c.step_s(max(batches)) * c.tail), kernels


def _batches(max_streams: int) -> list[int]:
    out, b = [], 1
    while b < max_streams:
        out.append(b)
        b *= 2
    return [*out, max_streams]


def run(args: argparse.Namespace) -> int:
    from syshax.shared.config import ConfigError, load_config
    from syshax.workers import capacity_plan as cp
    from syshax.workers.accelerator_profiles import ProfileError, load_profile, model_scale
    from syshax.workers.engine.errors import EngineError
    from syshax.workers.engine.loader import resolve_model_path

    try:
        cfg = load_config(args.config)
        profile = load_profile(args.profile or cfg.xpu.profile)
        model = str(resolve_model_path(args.model or cfg.model))
        scale = model_scale(model, profile)
        w = cp.Workload(args.input_len, args.output_len)
        slo_ms = args.slo_itl_ms if args.slo_itl_ms is not None else cfg.slo.itl_ms
        if slo_ms is not None and slo_ms <= 0:
            raise ValueError(f"--slo-itl-ms must be > 0, got {slo_ms}")
        slo = slo_ms / 1e3 if slo_ms else None
        over = _ms_pair(args.xpu_overhead_ms, "--xpu-overhead-ms")
        xpu = cp.XpuModel(profile, scale, args.xpu_slots or cfg.xpu.max_batch_size, over[0] / 1e3, over[1] / 1e3)  # fmt: skip
        cores = args.cores or len(os.sched_getaffinity(0))
        max_streams = args.cpu_max_batch or cfg.cpu_max_batch_size
        layouts = _layouts(args, cfg, cores)
        given = _given_curve(args.cpu_step_ms) if args.cpu_step_ms else None
        if min(args.xpu_slots or 1, max_streams, cores, args.probe_steps) < 1:
            raise ValueError("--xpu-slots, --cpu-max-batch, --cores and --probe-steps must be >= 1")  # fmt: skip
        if args.farm_tps is not None and args.farm_tps <= 0:
            raise ValueError(f"--farm-tps must be > 0, got {args.farm_tps}")
    except (ConfigError, ProfileError, EngineError, ValueError) as exc:
        print(f"syshax plan: error: {exc}", file=sys.stderr)
        return 2

    rows, kernels = [], "given (--cpu-step-ms)"
    for workers, threads in layouts:
        if given is not None:
            curve = given
        else:
            print(f"probing {workers} CPU worker(s) x {threads} thread(s) ...", file=sys.stderr, flush=True)  # fmt: skip
            try:
                curve, kernels = probe_layout(model, workers, threads, _batches(max_streams), int(w.mean_context), args.probe_steps)  # fmt: skip
            except (RuntimeError, OSError, ValueError) as exc:
                print(f"syshax plan: error: {exc}", file=sys.stderr)
                return 1
        rows.append(cp.CpuLayout(workers, threads, curve, max_streams))
    alone = cp.predict(xpu, w, None, slo, args.farm_tps)
    preds = [cp.predict(xpu, w, layout, slo, args.farm_tps) for layout in rows]
    top = cp.best([alone, *preds])
    report = _report(args, profile, scale, model, w, slo_ms, xpu, alone, preds, top, kernels)
    report["best_why"] = cp.why_best([alone, *preds], top)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(_tables(report))
    return 0


def _pred_dict(p, alone_tps: float) -> dict:
    lay = p.layout
    return {
        "workers": lay.workers if lay else 0,
        "threads": lay.threads if lay else 0,
        "step_ms_1_row": round(lay.curve.step_s(1) * 1e3, 3) if lay else None,
        "per_row_ms": round(lay.curve.per_row_s * 1e3, 3) if lay else None,
        "tail": round(lay.curve.tail, 2) if lay else None,
        "cpu_streams": p.cpu_streams,
        "cpu_itl_ms": round(p.cpu_itl_s * 1e3, 2) if p.cpu_itl_s else None,
        "cpu_itl_tail_ms": round(p.cpu_itl_tail_s * 1e3, 2) if p.cpu_itl_tail_s else None,
        "cpu_tok_s": round(p.cpu_tps, 1),
        "xpu_tok_s": round(p.xpu_tps, 1),
        "total_tok_s": round(p.total_tps, 1),
        "gain": round(p.total_tps / alone_tps - 1, 4) if alone_tps else None,
        "capped_by_farm": p.capped_by_farm,
    }


def _report(args, profile, scale, model, w, slo_ms, xpu, alone, preds, top, kernels) -> dict:
    return {
        "profile": profile.name,
        "model": model,
        "scale": {"weights": scale.weights, "kv": scale.kv, "params": scale.params},
        "workload": {"input_len": w.input_len, "output_len": w.output_len},
        "slo_itl_ms": slo_ms,
        "xpu": {
            "slots": xpu.slots,
            "decode_step_ms": round(xpu.decode_step_s(w) * 1e3, 3),
            "prefill_ms": round(xpu.prefill_s(w) * 1e3, 3),
        },  # fmt: skip
        "farm_tps": args.farm_tps,
        "cpu_kernels": kernels,
        "xpu_alone": _pred_dict(alone, alone.total_tps),
        "with_cpu": [_pred_dict(p, alone.total_tps) for p in preds],
        "best": _pred_dict(top, alone.total_tps),
    }


def _tables(r: dict) -> str:
    slo = f"ITL (slow steps included) <= {r['slo_itl_ms']:g} ms" if r["slo_itl_ms"] else "none"
    x, a = r["xpu"], r["xpu_alone"]
    lines = [
        f"profile {r['profile']} scaled to {r['model']} ({r['scale']['params'] / 1e6:.0f}M parameters: weights x{r['scale']['weights']:.4f}, KV x{r['scale']['kv']:.4f})",  # fmt: skip
        f"workload: {r['workload']['input_len']}-token prompts, {r['workload']['output_len']}-token answers, closed loop at saturation; SLO: {slo}",  # fmt: skip
        f"xPU: {x['slots']} streams, decode step {x['decode_step_ms']} ms, prefill {x['prefill_ms']} ms a prompt; alone: {a['total_tok_s']:.1f} tok/s"  # fmt: skip
        + (" (capped by --farm-tps)" if a["capped_by_farm"] else ""),
        f"CPU kernels: {r['cpu_kernels']}",
        "",
        "| CPU workers x threads | step ms (1 stream) | + ms per stream | slow-step factor | CPU streams | CPU ITL ms (slow) | CPU tok/s | xPU tok/s | total tok/s | vs xPU alone |",  # fmt: skip
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in r["with_cpu"]:
        itl = f"{p['cpu_itl_ms']} ({p['cpu_itl_tail_ms']})" if p["cpu_itl_ms"] else "-"
        cap = " (farm cap)" if p["capped_by_farm"] else ""
        lines.append(f"| {p['workers']} x {p['threads']} | {p['step_ms_1_row']} | {p['per_row_ms']} | {p['tail']} | {p['cpu_streams']} | {itl} | {p['cpu_tok_s']} | {p['xpu_tok_s']} | {p['total_tok_s']}{cap} | {p['gain']:+.1%} |")  # fmt: skip
    b = r["best"]
    if b["workers"] and b["cpu_streams"]:
        per = b["cpu_streams"] // b["workers"]
        lines += ["", f"best: cpu.workers: {b['workers']}, cpu.threads: {b['threads']}, cpu_max_batch_size: {per} -> {b['total_tok_s']} tok/s ({b['gain']:+.1%} over the xPU alone)"]  # fmt: skip
    else:
        lines += ["", "best: the xPU alone (decode_device: xpu)"]
    lines.append(f"why: {r['best_why']}")
    return "\n".join(lines)
