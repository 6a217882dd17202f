"""The speed model for speculative decoding: the bundled SmolLM2-135M with every FFN zero-padded
to 16,384 intermediate rows, quantized to Q4_0 by llama.cpp's own quantizer.

Random weights cannot measure speculation (nothing in a prompt predicts their output); a real
135M model streams too few bytes per token to show what a 1B model meets. Padding gives both:
the padded gate/up rows are zero, so their activations are silu(0) x 0 = 0, and the padded
down-projection columns are zero, so the FFN computes exactly SmolLM2's function while each
token streams ~0.5 GB at Q4_0, as a 1B model does. (The shipped Q4_1 weights are dequantized,
padded, written as F16 and requantized to Q4_0: the function is SmolLM2's at Q4_0 precision,
not bit-for-bit the Q4_1 file's.)

    python bench/spec_model.py            # prints the path (cached in ~/.cache/syshax/bench)
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize
from gguf_write import copy_field, finish, quantize, temporary
from tqdm import tqdm

CACHE = Path("~/.cache/syshax/bench").expanduser()
PADDED_FFN = 16384


def _copy_fields(reader: gguf.GGUFReader, writer: gguf.GGUFWriter, ffn: int) -> None:
    """Every metadata key of the source but the file's own (counts, type) and the FFN width."""
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        if name.endswith(".feed_forward_length"):
            writer.add_uint32(name, ffn)
            continue
        copy_field(writer, name, f)
    writer.add_file_type(1)  # MOSTLY_F16


def _padded(name: str, data: np.ndarray, ffn: int) -> np.ndarray:
    """gate/up [inter, hidden] get zero rows, down [hidden, inter] zero columns."""
    if name.endswith(("ffn_gate.weight", "ffn_up.weight")):
        out = np.zeros((ffn, data.shape[1]), dtype=data.dtype)
        out[: data.shape[0]] = data
        return out
    if name.endswith("ffn_down.weight"):
        out = np.zeros((data.shape[0], ffn), dtype=data.dtype)
        out[:, : data.shape[1]] = data
        return out
    return data


def write_padded_f16(src: Path, dst: Path, ffn: int = PADDED_FFN) -> Path:
    """`src` dequantized, its FFNs padded to `ffn` rows, as an F16 GGUF (norms stay F32)."""
    reader = gguf.GGUFReader(src)
    tmp = temporary(dst)
    writer = gguf.GGUFWriter(tmp, "llama")
    _copy_fields(reader, writer, ffn)
    for t in tqdm(reader.tensors, desc="padding SmolLM2", unit="tensor", file=sys.stderr):
        data = dequantize(t.data, t.tensor_type).astype(np.float32)
        data = _padded(t.name, data, ffn)
        data = data.astype(np.float16) if data.ndim == 2 else data
        writer.add_tensor(t.name, data, raw_dtype=T.F16 if data.ndim == 2 else T.F32)
    return finish(writer, tmp, dst)


def speed_model(threads: int = 2, cache: Path = CACHE, keep_f16: bool = False) -> Path:
    """The cached padded SmolLM2 at Q4_0, made if absent."""
    from syshax.shared.default_model import default_model_path

    cache.mkdir(parents=True, exist_ok=True)
    dst = cache / f"smollm2-135m-ffn{PADDED_FFN}.Q4_0.gguf"
    if dst.is_file():
        return dst
    f16 = cache / f"smollm2-135m-ffn{PADDED_FFN}.F16.gguf"
    if not f16.is_file():
        write_padded_f16(Path(default_model_path()), f16)
    print(f"# llama.cpp quantizes {f16.name} -> Q4_0", file=sys.stderr, flush=True)
    quantize(f16, dst, "Q4_0", threads)
    if not keep_f16:
        f16.unlink()
    return dst


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="quantizer threads")
    p.add_argument("--keep-f16", action="store_true", help="keep the padded F16 source (1.7 GB)")
    args = p.parse_args(argv)
    print(speed_model(args.threads, keep_f16=args.keep_f16))


if __name__ == "__main__":
    main()
