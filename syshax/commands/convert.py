"""`syshax convert MODEL.gguf OUTDIR`: a GGUF file as a Hugging Face model folder.

The work is in `workers/engine/hf_export.py`; this module parses and reports. Light imports at
module level: the parser is built for `syshax --help` without loading torch.
"""

from __future__ import annotations

import argparse
import sys

DTYPES = ("bfloat16", "float16", "float32")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Write a GGUF model file (Llama, Qwen2, Qwen3, Mistral) as a Hugging Face model folder "
        "that transformers, vLLM and this engine (`--model OUTDIR`, the `model` setting) load: config.json, "
        "generation_config.json, safetensors weights (HF names and row order), tokenizer.json "
        "and tokenizer_config.json with the GGUF's chat template, syshax.json with the GGUF's "
        "weights digest (so workers on the folder and on the GGUF exchange KV). A quantized GGUF is "
        "dequantized: the folder is larger than the file (bfloat16: about 2 bytes per "
        "parameter; a 4-bit GGUF takes about 0.6)."
    )
    p.add_argument(
        "model",
        metavar="MODEL.gguf",
        help="the GGUF file to convert; 'default' = the bundled SmolLM2-135M-Instruct",
    )
    p.add_argument(
        "out_dir",
        metavar="OUTDIR",
        help="the folder to write (created if missing; must be empty unless --force)",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default="bfloat16",
        help="float type of the written weights; every tensor is dequantized to it "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--shard-size",
        default="4GB",
        metavar="SIZE",
        help="largest weights file (e.g. 4GB, 500MB, 2GiB); larger weights are written as "
        "model-0000k-of-0000N.safetensors shards with model.safetensors.index.json "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="write into a non-empty OUTDIR, replacing the model files there (weights, "
        "config, tokenizer and chat template files; other files stay)",
    )
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def run(args: argparse.Namespace) -> int:
    try:
        from syshax.workers.engine.errors import EngineError
        from syshax.workers.engine.hf_export import export_hf, parse_size

        shard_size = parse_size(args.shard_size)
        model = args.model
        if model == "default":
            from syshax.shared.default_model import default_model_path

            model = default_model_path()  # FileNotFoundError (an OSError) with how to install
        result = export_hf(
            model,
            args.out_dir,
            dtype=args.dtype,
            shard_size=shard_size,
            force=args.force,
            progress=not args.no_progress,
        )
    except (EngineError, ValueError, OSError) as exc:
        print(f"syshax convert: error: {exc}", file=sys.stderr)
        return 2
    shards = f" in {result.shards} shards" if result.shards > 1 else ""
    print(
        f"wrote {result.out_dir}: {result.tensors} tensors, "
        f"{result.weight_bytes / 1e9:.2f} GB of {args.dtype} weights{shards}; weights "
        f"digest {result.weights_digest} (the GGUF's, recorded in syshax.json)",
        file=sys.stderr,
    )
    return 0
