"""Random-weight GGUFs with public models' shapes, quantized by llama.cpp's own quantizer.

SPEED ONLY: the weights are random, the text they produce is meaningless. The shapes are the
public configurations' (layers, widths, heads, FFN, tied or untied output, Qwen2's q/k/v
biases); the vocabulary and tokenizer are the bundled SmolLM2's (49,152 tokens), so every shape
tokenizes the same prompts and the LM head is smaller than the real model's (say so when you
quote a figure).

How: a Q8_0 source is written tensor by tensor (random int8 quants, a fixed fp16 scale giving
weights of standard deviation ~0.02; norms are ones), then llama.cpp's `llama_model_quantize`
(llama-cpp-python 0.3.36) requantizes it to Q4_0, Q8_0 or Q4_K_M as `llama-quantize` would.
Files are cached in ~/.cache/syshax/bench/shapes.

    python bench/gguf_shapes.py --shape 1b --type Q4_K_M     # prints the path
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T
from gguf_write import FTYPES, copy_field, quantize, temporary
from tqdm import tqdm

CACHE = Path("~/.cache/syshax/bench/shapes").expanduser()

# name -> (public model, hidden, layers, heads, kv heads, ffn, tied output, rope theta, arch)
SHAPES: dict[str, tuple[str, int, int, int, int, int, bool, float, str]] = {
    "1b": ("Llama-3.2-1B", 2048, 16, 32, 8, 8192, True, 500000.0, "llama"),
    "3b": ("Llama-3.2-3B", 3072, 28, 24, 8, 8192, True, 500000.0, "llama"),
    "8b": ("Llama-3.1-8B", 4096, 32, 32, 8, 14336, False, 500000.0, "llama"),
    "qwen7b": ("Qwen2.5-7B", 3584, 28, 28, 4, 18944, False, 1000000.0, "qwen2"),
}
_Q8_SCALE = np.float16(0.02 / 73)  # uniform int8 quants have a standard deviation of ~73


def _tokenizer_fields(writer: gguf.GGUFWriter) -> int:
    """Copy the bundled SmolLM2's tokenizer.* keys; returns its vocabulary size."""
    from syshax.shared.default_model import default_model_path

    reader = gguf.GGUFReader(default_model_path())
    vocab = 0
    for name, f in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        copy_field(writer, name, f)
        if name == "tokenizer.ggml.tokens":
            vocab = len(f.contents())
    return vocab


def _tensors(shape: str, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    _, hidden, layers, heads, kv, ffn, tied, _, arch = SHAPES[shape]
    hd = hidden // heads
    out = [("token_embd.weight", (vocab, hidden)), ("output_norm.weight", (hidden,))]
    if not tied:
        out.append(("output.weight", (vocab, hidden)))
    for i in range(layers):
        b = f"blk.{i}."
        out += [
            (b + "attn_norm.weight", (hidden,)),
            (b + "ffn_norm.weight", (hidden,)),
            (b + "attn_q.weight", (heads * hd, hidden)),
            (b + "attn_k.weight", (kv * hd, hidden)),
            (b + "attn_v.weight", (kv * hd, hidden)),
            (b + "attn_output.weight", (hidden, heads * hd)),
            (b + "ffn_gate.weight", (ffn, hidden)),
            (b + "ffn_up.weight", (ffn, hidden)),
            (b + "ffn_down.weight", (hidden, ffn)),
        ]
        if arch == "qwen2":
            out += [(b + f"attn_{x}.bias", (n * hd,)) for x, n in (("q", heads), ("k", kv), ("v", kv))]  # fmt: skip
    return out


def _data(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> tuple[np.ndarray, T]:
    if len(shape) == 1:
        value = 1.0 if name.endswith("norm.weight") else 0.0
        return np.full(shape, value, dtype=np.float32), T.F32
    rows, cols = shape
    blocks = np.empty((rows, cols // 32, 34), dtype=np.uint8)
    blocks[:, :, :2] = np.frombuffer(_Q8_SCALE.tobytes(), dtype=np.uint8)
    blocks[:, :, 2:] = rng.integers(0, 256, size=(rows, cols // 32, 32), dtype=np.uint8)
    blocks[:, :, 2:][blocks[:, :, 2:] == 128] = 129  # no -128: ggml's Q8_0 range is +-127
    return blocks.reshape(rows, -1), T.Q8_0


def write_source(shape: str, path: Path, seed: int = 0) -> Path:
    """The Q8_0 random-weight source of `shape`, written tensor by tensor (bounded memory)."""
    model, hidden, layers, heads, kv, ffn, _, theta, arch = SHAPES[shape]
    tmp = temporary(path)
    w = gguf.GGUFWriter(tmp, arch)
    w.add_name(f"random-weight {model} shape (speed only)")
    w.add_block_count(layers)
    w.add_context_length(8192)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(7)  # MOSTLY_Q8_0
    vocab = _tokenizer_fields(w)
    w.add_vocab_size(vocab)
    specs = _tensors(shape, vocab)
    for name, shp in specs:
        if len(shp) == 1:
            w.add_tensor_info(name, shp, np.dtype(np.float32), shp[0] * 4, raw_dtype=T.F32)
        else:  # the writer takes a block type's shape in bytes: (rows, bytes per row)
            byte_shape = (shp[0], shp[1] // 32 * 34)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), byte_shape[0] * byte_shape[1], raw_dtype=T.Q8_0)  # fmt: skip
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, shp in tqdm(specs, desc=f"writing {shape} source", unit="tensor", file=sys.stderr):
        data, _ = _data(name, shp, rng)
        w.write_tensor_data(data)
    w.close()
    tmp.replace(path)
    return path


def shaped(shape: str, ftype: str, threads: int = 2, cache: Path = CACHE) -> Path:
    """The cached `shape` file in `ftype`, made (source, then llama.cpp quantization) if absent."""
    if shape not in SHAPES:
        raise ValueError(f"shape {shape!r} is not one of {', '.join(SHAPES)}")
    cache.mkdir(parents=True, exist_ok=True)
    src = cache / f"{shape}.random.Q8_0.gguf"
    if not src.is_file():
        print(f"# writing the random-weight {shape} source -> {src}", file=sys.stderr, flush=True)
        write_source(shape, src)
    if ftype == "Q8_0":
        return src
    dst = cache / f"{shape}.random.{ftype}.gguf"
    if not dst.is_file():
        print(f"# llama.cpp quantizes {src.name} -> {ftype}", file=sys.stderr, flush=True)
        quantize(src, dst, ftype, threads)
    return dst


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--shape", choices=list(SHAPES), default="1b", help="public model shape (default 1b)")  # fmt: skip
    p.add_argument("--type", dest="ftype", choices=list(FTYPES), default="Q4_0", help="llama.cpp quantization (default Q4_0)")  # fmt: skip
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="quantizer threads")
    args = p.parse_args(argv)
    print(shaped(args.shape, args.ftype, args.threads))


if __name__ == "__main__":
    main()
