"""Quality of our CPU engine against llama.cpp's on the same files: perplexity and KL
divergence from the float model, `syshax eval perplexity` beside `llama-perplexity
--kl-divergence`.

The base is the shipped SmolLM2-135M-Instruct Q4_1 dequantized to an F32 GGUF (gguf-py,
bench/gguf_convert.py); Q4_0, Q8_0 and Q4_K_M are made from it by llama.cpp's quantizer
(llama-quantize from bench/llama_server.sh's build when it is there, else llama-cpp-python's
llama_model_quantize: the same code). Both tools then score the same text at the same context
(-c 512: the second half of each chunk), each against its own base run of the F32 file, and a
table puts the figures side by side with our KLD over llama.cpp's per type (goal <= 1.05).

    python bench/perplexity.py                       # GPL-3 text (34 KB), -c 512, 2 threads
    python bench/perplexity.py --text FILE --types Q4_0,Q8_0 --ctx 256

Files go to ~/.cache/syshax/perplexity (base logits: ~100 KB per scored token, each tool).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import gguf_convert  # noqa: E402

DEFAULT_TEXT = Path("/usr/share/common-licenses/GPL-3")
CACHE = Path("~/.cache/syshax/perplexity").expanduser()
LLAMA_BIN = Path("~/.cache/syshax/llama-server").expanduser()
FTYPES = {"Q4_0": 2, "Q8_0": 7, "Q4_K_M": 15}  # llama_ftype values, as llama-quantize names them


def base_model(cache: Path) -> Path:
    """The shipped Q4_1 file dequantized to F32 (made once)."""
    from syshax.workers.engine.loader import resolve_model_path

    return gguf_convert.cached(resolve_model_path("default"), "F32", cache)


def quantized(base: Path, qtype: str, threads: int, bin_dir: Path) -> Path:
    """`base` quantized to `qtype` by llama.cpp's quantizer (made once)."""
    dst = base.with_name(base.name.replace(".F32.gguf", f".{qtype}.gguf"))
    if dst.is_file():
        return dst
    tmp = dst.with_name(dst.name + f".{os.getpid()}.tmp")
    tool = bin_dir / "llama-quantize"
    print(f"# quantizing {base.name} to {qtype} -> {dst}", file=sys.stderr, flush=True)
    if tool.is_file():
        subprocess.run(
            [str(tool), str(base), str(tmp), qtype, str(threads)],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    else:
        import llama_cpp

        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.nthread = FTYPES[qtype], threads
        if llama_cpp.llama_model_quantize(
            str(base).encode(), str(tmp).encode(), ctypes.byref(params)
        ):
            tmp.unlink(missing_ok=True)
            raise RuntimeError(f"llama_model_quantize({base} -> {qtype}) failed")
    tmp.replace(dst)
    return dst


def ours(
    model: Path, text: Path, ctx: int, threads: int, logits: Path, base: bool, *extra: str
) -> dict:
    """`syshax eval perplexity` on `model` (its CPU default: native blocks, fused step, unless
    `extra` options say otherwise)."""
    flag = "--save-logits" if base else "--kl-base"
    cmd = [sys.executable, "-m", "syshax.cli", "eval", "perplexity", "--model", str(model)]
    cmd += ["--text", str(text), "--ctx", str(ctx), "--threads", str(threads), flag, str(logits)]
    cmd += extra
    out = subprocess.run(cmd + ["--json", "--no-progress"], check=True, capture_output=True)
    r = json.loads(out.stdout.decode().strip().splitlines()[-1])
    kl = r.get("kl") or {}
    return {
        "ppl": r["ppl"],
        "ppl_err": r["ppl_err"],
        "count": r["count"],
        "seconds": r["seconds"],
        "kld": kl.get("kld"),
        "kld_err": kl.get("kld_err"),
        "same_top": 100 * kl["same_top"] if kl else None,
        "rms_dp": 100 * kl["rms_dp"] if kl else None,
    }


_LLAMA = {
    "ppl": r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)",
    "ppl_q": r"Mean PPL\(Q\)\s*:\s*([\d.]+) ± +([\d.]+)",
    "kld": r"Mean +KLD:\s*([-\d.]+) ± +([\d.]+)",
    "rms_dp": r"RMS Δp +:\s*([\d.]+) ± +([\d.]+) %",
    "same_top": r"Same top p:\s*([\d.]+) ± +([\d.]+) %",
}


def llama(model: Path, text: Path, ctx: int, threads: int, logits: Path, base: bool, bin_dir: Path) -> dict:  # fmt: skip
    """llama-perplexity on `model`: the base run writes `logits`, the others compare."""
    cmd = [str(bin_dir / "llama-perplexity"), "-m", str(model), "-f", str(text), "-c", str(ctx)]
    cmd += ["-t", str(threads), "-b", str(max(ctx, 512)), "--kl-divergence-base", str(logits)]
    if not base:
        cmd.append("--kl-divergence")
    started = time.perf_counter()
    run = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = run.stdout.decode(errors="replace")
    if run.returncode:
        raise RuntimeError(f"llama-perplexity failed ({run.returncode}):\n{out[-2000:]}")
    found = {k: re.search(p, out) for k, p in _LLAMA.items()}
    ppl = found["ppl"] or found["ppl_q"]
    if ppl is None:
        raise RuntimeError(f"no PPL in llama-perplexity's output:\n{out[-2000:]}")
    r = {"ppl": float(ppl[1]), "ppl_err": float(ppl[2]), "seconds": time.perf_counter() - started}
    for key in ("kld", "rms_dp", "same_top"):
        r[key] = float(found[key][1]) if found[key] else None
    r["kld_err"] = float(found["kld"][2]) if found["kld"] else None
    return r


def llama_logits_file(model: Path, text: Path, ctx: int, threads: int, out: Path) -> Path:
    """llama.cpp's own logits for the scored rows of `model` (llama-cpp-python, logits_all),
    written as a --save-logits file: `syshax eval perplexity --kl-base` on the same model then
    gives KL(llama.cpp || ours) on one file, how far the two runtimes are apart."""
    import llama_cpp
    import numpy as np
    from syshax.shared.tokenizer import Tokenizer
    from syshax.workers.eval.logit_file import LogitWriter, RunShape
    from syshax.workers.eval.perplexity import first_scored, plan_chunks
    from syshax.workers.eval.stats import log_softmax

    tokens = Tokenizer.from_model_path(model).encode(text.read_text(encoding="utf-8"))
    n_chunks, first = plan_chunks(len(tokens), ctx), first_scored(ctx)
    llm = llama_cpp.Llama(
        str(model), n_ctx=ctx, n_batch=ctx, n_ubatch=ctx, logits_all=True,
        n_threads=threads, n_threads_batch=threads, verbose=False,
    )  # fmt: skip
    vocab = llm.n_vocab()
    writer = LogitWriter(
        out, RunShape.of(tokens, ctx, vocab, n_chunks, ctx - 1 - first), "llama.cpp"
    )
    for i in range(n_chunks):
        llm.reset()
        llm.eval(tokens[i * ctx : (i + 1) * ctx])
        writer.write_chunk(log_softmax(np.asarray(llm.scores[first : ctx - 1])))
    writer.close()
    return out


def cross(models: dict[str, Path], args: argparse.Namespace) -> list[str]:
    """Per type: KL(llama.cpp's predictions || ours) on the same file and text, for our
    default (8-bit activations into the quantized GEMM, fp16 KV) and for our float path (the
    same weights dequantized, float activations and KV): how much of the gap is rounding of
    activations."""
    lines = ["", "same file, llama.cpp (llama-cpp-python) as the base, ours compared:"]
    paths = {"fused": (), "float": ("--quantize", "none", "--op-mode", "none")}
    for name, model in models.items():
        ref = args.cache / f"cross.{name}.logp"
        try:
            llama_logits_file(model, args.text, args.ctx, args.threads, ref)
            for path, extra in paths.items():
                o = ours(model, args.text, args.ctx, args.threads, ref, False, *extra)
                lines.append(
                    f"{name:8} ours {path:5}: KLD {o['kld']:.6f} ± {o['kld_err']:.6f}, "
                    f"same top {o['same_top']:.2f} %, RMS dp {o['rms_dp']:.3f} %"
                )
        finally:
            ref.unlink(missing_ok=True)
    return lines


def _cell(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def _pm(v, err, fmt: str, err_fmt: str) -> str:
    """`v±err`, or a dash padded to the width when there is no value (the base's KLD)."""
    if v is None:
        return format("-", f">{len(format(0.0, fmt)) + 1 + len(format(0.0, err_fmt))}")
    return f"{format(v, fmt)}±{format(err, err_fmt)}"


def table(rows: list[tuple[str, dict, dict | None]]) -> str:
    """Side by side: ours / llama.cpp's per figure, and our KLD over theirs."""
    head = (
        f"{'type':8} {'PPL ours':>16} {'PPL llama.cpp':>16} {'KLD ours':>17} "
        f"{'KLD llama.cpp':>17} {'same top %':>13} {'RMS dp %':>13} {'KLD ratio':>9}"
    )
    lines = [head, "-" * len(head)]
    for name, o, ll in rows:
        ll = ll or {}
        ratio = o["kld"] / ll["kld"] if o.get("kld") and ll.get("kld") else None
        lines.append(
            f"{name:8} {_pm(o['ppl'], o['ppl_err'], '9.4f', '<6.3f')} "
            f"{_pm(ll.get('ppl'), ll.get('ppl_err'), '9.4f', '<6.3f')} "
            f"{_pm(o.get('kld'), o.get('kld_err'), '9.6f', '<7.5f')} "
            f"{_pm(ll.get('kld'), ll.get('kld_err'), '9.6f', '<7.5f')} "
            f"{_cell(o.get('same_top'), '6.2f')}/{_cell(ll.get('same_top'), '<6.2f')} "
            f"{_cell(o.get('rms_dp'), '6.3f')}/{_cell(ll.get('rms_dp'), '<6.3f')} "
            f"{_cell(ratio, '9.3f')}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--text", type=Path, default=DEFAULT_TEXT, help="text to score (default: %(default)s)"
    )
    ap.add_argument(
        "--ctx", type=int, default=512, help="chunk length, both tools (default: %(default)s)"
    )
    ap.add_argument(
        "--types", default="Q4_0,Q4_K_M,Q8_0", help="quantized types (default: %(default)s)"
    )
    ap.add_argument(
        "--threads", type=int, default=2, help="threads, both tools (default: %(default)s)"
    )
    ap.add_argument(
        "--cache",
        type=Path,
        default=CACHE,
        help="where models and logits go (default: %(default)s)",
    )
    ap.add_argument(
        "--llama-bin",
        type=Path,
        default=LLAMA_BIN,
        help="llama-perplexity's folder (default: %(default)s)",
    )
    ap.add_argument("--skip-llama", action="store_true", help="ours only (no llama-perplexity)")
    ap.add_argument(
        "--cross",
        action="store_true",
        help="also: KL between llama.cpp's and our predictions on each same file",
    )
    ap.add_argument(
        "--keep-logits", action="store_true", help="keep the base logits files after the run"
    )
    args = ap.parse_args(argv)
    types = [t for t in args.types.split(",") if t]
    unknown = [t for t in types if t not in FTYPES]
    if unknown:
        ap.error(f"unknown type(s) {unknown}; choose from {sorted(FTYPES)}")
    with_llama = not args.skip_llama
    if with_llama and not (args.llama_bin / "llama-perplexity").is_file():
        ap.error(
            f"no llama-perplexity in {args.llama_bin}: run bench/llama_server.sh, or --skip-llama"
        )
    args.cache.mkdir(parents=True, exist_ok=True)
    base = base_model(args.cache)
    models = {t: quantized(base, t, args.threads, args.llama_bin) for t in types}
    ours_base, llama_base = args.cache / "base.ours.logp", args.cache / "base.llama.kld"
    print(
        f"# text {args.text} ({args.text.stat().st_size} bytes), -c {args.ctx}, {args.threads} threads",
        flush=True,
    )
    rows = []
    try:
        o = ours(base, args.text, args.ctx, args.threads, ours_base, base=True)
        ll = (
            llama(base, args.text, args.ctx, args.threads, llama_base, True, args.llama_bin)
            if with_llama
            else None
        )
        rows.append(("F32", o, ll))
        print(f"# F32 base: ours {o['seconds']:.0f} s, PPL {o['ppl']:.4f}", flush=True)
        for t in types:
            o = ours(models[t], args.text, args.ctx, args.threads, ours_base, base=False)
            ll = llama(models[t], args.text, args.ctx, args.threads, llama_base, False, args.llama_bin) if with_llama else None  # fmt: skip
            rows.append((t, o, ll))
            print(
                f"# {t}: ours KLD {o['kld']:.6f}" + (f", llama.cpp {ll['kld']:.6f}" if ll else ""),
                flush=True,
            )
    finally:
        if not args.keep_logits:
            for f in (ours_base, llama_base):
                f.unlink(missing_ok=True)
    print(table(rows))
    if args.cross:
        print("\n".join(cross({"F32": base, **models}, args)), flush=True)
    print(json.dumps({"text": str(args.text), "ctx": args.ctx, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
