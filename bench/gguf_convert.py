"""Convert a GGUF model file to another GGUF weight type (Q4_0, Q8_0, F16 or F32).

Every 2-D weight tensor whose row length is a multiple of 32 (one ggml block), token_embd.weight
included, is dequantized with `gguf.quants.dequantize` and written in the new type with
`gguf.quants.quantize` (ggml's reference rounding, what llama.cpp's quantizer writes without an
importance matrix). Every other tensor (norms, 1-D) is written as float32. Tensors keep the
order and the row order of the source (llama.cpp's q/k row permutation stays), so the result is
a valid llama.cpp file. All metadata is copied from the source except `general.file_type`,
which names the new type. Benchmarks use it to give several engines the same weights:

    python bench/gguf_convert.py SRC.gguf DST.gguf --type Q4_0
    python bench/gguf_convert.py --type Q8_0        # default model -> the cache dir; prints path

`cached(src, qtype)` converts once and reuses the file (cache key: the source's name, size and
mtime; default directory ~/.cache/syshax/bench).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Literal

import gguf
import numpy as np
from tqdm import tqdm

QType = Literal["Q4_0", "Q8_0", "F16", "F32"]
QTYPES: dict[str, tuple[gguf.GGMLQuantizationType, gguf.LlamaFileType]] = {
    "Q4_0": (gguf.GGMLQuantizationType.Q4_0, gguf.LlamaFileType.MOSTLY_Q4_0),
    "Q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
    "F16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
    "F32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
}
BLOCK = 32
DEFAULT_CACHE = Path("~/.cache/syshax/bench")


def _copy_metadata(reader: gguf.GGUFReader, writer: gguf.GGUFWriter, file_type: int) -> None:
    """Every key/value of the source except the reader's virtual GGUF.* fields and the
    architecture (the writer adds it); general.file_type = the new type."""
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name == gguf.Keys.General.ARCHITECTURE:
            continue
        if name == gguf.Keys.General.FILE_TYPE:
            continue  # written below, after the copied keys
        vtype = gguf.GGUFValueType(f.types[0])
        if vtype == gguf.GGUFValueType.ARRAY:
            if len(f.types) > 2:
                print(f"# {name}: nested arrays are not copied", file=sys.stderr)
                continue
            value = f.contents()
            if not value:
                continue  # the writer refuses empty arrays
            writer.add_key_value(name, value, vtype, sub_type=gguf.GGUFValueType(f.types[-1]))
        else:
            writer.add_key_value(name, f.contents(), vtype)
            if name == gguf.Keys.General.ALIGNMENT:
                writer.data_alignment = int(f.contents())
    writer.add_key_value(gguf.Keys.General.FILE_TYPE, file_type, gguf.GGUFValueType.UINT32)


def _architecture(reader: gguf.GGUFReader) -> str:
    field = reader.get_field(gguf.Keys.General.ARCHITECTURE)
    if field is None:
        raise ValueError("the source has no general.architecture")
    return str(field.contents())


def converted_type(t: gguf.ReaderTensor, qtype: gguf.GGMLQuantizationType) -> gguf.GGMLQuantizationType:  # fmt: skip
    """What a tensor becomes: `qtype` for 2-D tensors with whole-block rows, else F32."""
    shape = [int(n) for n in t.shape]  # ggml order: shape[0] = row length
    if len(shape) == 2 and shape[0] % BLOCK == 0:
        return qtype
    return gguf.GGMLQuantizationType.F32


def convert(src: Path, dst: Path, qtype: QType, progress: bool = True) -> Path:
    """Write `src` with its weights in `qtype` to `dst` (via dst.tmp, renamed when complete)."""
    if qtype not in QTYPES:
        raise ValueError(f"type {qtype!r} is not supported; use one of {', '.join(QTYPES)}")
    target, file_type = QTYPES[qtype]
    reader = gguf.GGUFReader(src)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + f".{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(tmp, _architecture(reader))
    try:
        _copy_metadata(reader, writer, int(file_type))
        bar = tqdm(reader.tensors, desc=f"{src.name} -> {qtype}", unit="tensor", disable=not progress)  # fmt: skip
        for t in bar:
            floats = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
            ggml_shape = [int(n) for n in t.shape]
            floats = floats.reshape(list(reversed(ggml_shape)))  # numpy order: rows first
            new = converted_type(t, target)  # float: F32/F16 array; blocks: uint8 [rows, bytes]
            writer.add_tensor(t.name, gguf.quants.quantize(floats, new), raw_dtype=new)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file(progress=False)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    writer.close()
    tmp.replace(dst)
    return dst


def cache_name(src: Path, qtype: str) -> str:
    st = src.stat()
    return f"{src.stem}.{st.st_size}-{st.st_mtime_ns}.{qtype}.gguf"


def cached(src: Path, qtype: QType, cache_dir: Path | None = None, progress: bool = True) -> Path:
    """The converted file from the cache, converting `src` first if it is not there."""
    dst = (cache_dir or DEFAULT_CACHE).expanduser() / cache_name(src, qtype)
    if dst.is_file():
        return dst
    print(f"# converting {src.name} to {qtype} -> {dst}", file=sys.stderr, flush=True)
    return convert(src, dst, qtype, progress)


def describe(path: Path) -> dict[str, int]:
    """How many tensors of each ggml type a file holds, e.g. {'Q4_0': 211, 'F32': 61}."""
    counts: dict[str, int] = {}
    for t in gguf.GGUFReader(path).tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return counts


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("src", type=Path, nargs="?", help="source GGUF (default: the bundled SmolLM2-135M-Instruct Q4_1)")  # fmt: skip
    p.add_argument("dst", type=Path, nargs="?", help="output GGUF (default: a file in --cache-dir, reused when it exists)")  # fmt: skip
    p.add_argument("--type", dest="qtype", choices=list(QTYPES), default="Q4_0", help="weight type of the output (default Q4_0)")  # fmt: skip
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help=f"where cached conversions live (default {DEFAULT_CACHE})")  # fmt: skip
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.src is None:
        from syshax.shared.default_model import default_model_path

        args.src = default_model_path()
    if args.dst is None:
        out = cached(args.src, args.qtype, args.cache_dir, not args.quiet)
    else:
        out = convert(args.src, args.dst, args.qtype, not args.quiet)
    print(out)
    print(f"# tensor types: {describe(out)}", file=sys.stderr)


if __name__ == "__main__":
    main()
