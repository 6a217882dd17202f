"""What the benchmark scripts that write GGUF files with gguf-py share (draft_model.py,
spec_model.py, gguf_shapes.py): the temporary name a file is written under, copying one metadata
key of a source file, writing a writer's file out and moving it into place whole, and llama.cpp's
own quantizer (llama-cpp-python's llama_model_quantize, what llama-quantize runs).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import gguf

# llama.cpp's llama_ftype values, by the names llama-quantize gives them.
FTYPES = {"Q4_0": 2, "Q8_0": 7, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18}


def temporary(dst: Path) -> Path:
    """Where `dst` is written until it is complete (one name per process)."""
    return dst.with_name(dst.name + f".{os.getpid()}.tmp")


def copy_field(writer: gguf.GGUFWriter, name: str, field: gguf.ReaderField) -> None:
    """A source's metadata key `name` onto `writer`, with its type (an array's with its items')."""
    vtype = gguf.GGUFValueType(field.types[0])
    if vtype == gguf.GGUFValueType.ARRAY:
        sub = gguf.GGUFValueType(field.types[-1])
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub)
    else:
        writer.add_key_value(name, field.contents(), vtype)


def finish(writer: gguf.GGUFWriter, tmp: Path, dst: Path) -> Path:
    """Write out `writer` (opened on `tmp`, its keys and tensors added), close it and rename it
    to `dst`: a reader of `dst` finds the whole file or none."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()
    tmp.replace(dst)
    return dst


def quantize(src: Path, dst: Path, ftype: str, threads: int) -> Path:
    """`src` quantized to `ftype` (a name of FTYPES) by llama.cpp, written to `dst` whole."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[ftype]
    params.nthread = threads
    params.allow_requantize = True
    tmp = temporary(dst)
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama_model_quantize({src} -> {ftype}) failed with {rc}")
    tmp.replace(dst)
    return dst
