"""ctypes bindings of the native CPU kernels (workers/cpu/native/sx.h), loaded once per variant.

The structs mirror sx.h field for field. Functions take raw pointers: callers pass contiguous
torch tensors (`ptr(t)`) and keep them alive for as long as the kernels may read them.
"""

from __future__ import annotations

import ctypes
import functools
from ctypes import POINTER, c_char_p, c_float, c_int, c_int32, c_int64, c_void_p

import torch

from .build import library_path

F32, Q4_0, Q8_0 = 0, 2, 8
QTYPES = {"q4_0": Q4_0, "q8_0": Q8_0}
BLOCK = 32
BLOCK_BYTES = {Q4_0: 18, Q8_0: 34}
ACT_BLOCK_BYTES = 64  # sx_act_block: 32 signed quants + the same as unsigned


class SxMat(ctypes.Structure):
    _fields_ = [
        ("type", c_int32),
        ("rows", c_int32),
        ("cols", c_int32),
        ("pad_", c_int32),
        ("data", c_void_p),
        ("bias", c_void_p),
    ]


class SxLayer(ctypes.Structure):
    _fields_ = [
        ("attn_norm", c_void_p),
        ("ffn_norm", c_void_p),
        ("q_norm", c_void_p),
        ("k_norm", c_void_p),
        ("qkv", SxMat),
        ("o", SxMat),
        ("gate_up", SxMat),
        ("down", SxMat),
        ("k_cache", c_void_p),
        ("v_cache", c_void_p),
    ]


class SxModel(ctypes.Structure):
    _fields_ = [
        ("n_layers", c_int32),
        ("hidden", c_int32),
        ("n_heads", c_int32),
        ("n_kv_heads", c_int32),
        ("head_dim", c_int32),
        ("inter", c_int32),
        ("vocab", c_int32),
        ("max_len", c_int32),
        ("n_slots", c_int32),
        ("kv_f16", c_int32),
        ("eps", c_float),
        ("embed", c_void_p),
        ("final_norm", c_void_p),
        ("lm_head", SxMat),
        ("rope_cos", c_void_p),
        ("rope_sin", c_void_p),
        ("layers", POINTER(SxLayer)),
    ]


_SIGNATURES = {
    "sx_simd": (c_char_p, []),
    "sx_max_threads": (c_int, []),
    "sx_quantize": (None, [c_int, c_void_p, c_int64, c_void_p]),
    "sx_dequantize": (None, [c_int, c_void_p, c_int64, c_void_p]),
    "sx_quantize_act": (None, [c_void_p, c_int, c_int, c_void_p, c_void_p, c_void_p]),
    "sx_packed_bytes": (ctypes.c_size_t, [c_int, c_int, c_int]),
    "sx_pack": (None, [c_int, c_void_p, c_int, c_int, c_void_p, c_int, c_int]),
    "sx_unpack": (None, [c_int, c_void_p, c_int, c_int, c_void_p]),
    "sx_gemm": (None, [POINTER(SxMat), c_int, c_void_p, c_void_p, c_int, c_int]),
    "sx_pin_threads": (c_int, [POINTER(c_int), c_int]),
    "sx_place_kv": (None, [c_void_p, c_void_p, c_int, c_int, c_int, c_int, c_int, c_int, c_int]),
    "sx_ctx_new": (c_void_p, [POINTER(SxModel), c_int, c_int, c_int]),
    "sx_ctx_free": (None, [c_void_p]),
    "sx_decode": (c_int, [c_void_p, c_int, c_void_p, c_void_p, c_void_p]),
    "sx_rmsnorm": (None, [c_void_p, c_void_p, c_int, c_float, c_void_p]),
    "sx_softmax_inplace": (None, [c_void_p, c_int]),
}


@functools.cache
def load(variant: str = "native") -> ctypes.CDLL:
    """The kernels library (compiled on first use, see build.py)."""
    lib = ctypes.CDLL(str(library_path(variant)))
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def ptr(t: torch.Tensor | None) -> int | None:
    if t is None:
        return None
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("native kernels need contiguous CPU tensors")
    return t.data_ptr()


def row_bytes(qtype: int, cols: int) -> int:
    return cols * 4 if qtype == F32 else cols // BLOCK * BLOCK_BYTES[qtype]


def quantize(x: torch.Tensor, qtype: int, variant: str = "native") -> torch.Tensor:
    """Float [rows, cols] -> GGML blocks as uint8 [rows, bytes per row] (ggml's reference)."""
    x = x.detach().to(torch.float32).contiguous()
    rows, cols = x.shape
    if cols % BLOCK:
        raise ValueError(f"{cols} columns is not a multiple of the {BLOCK}-weight block")
    out = torch.empty((rows, row_bytes(qtype, cols)), dtype=torch.uint8)
    load(variant).sx_quantize(qtype, ptr(x), x.numel(), ptr(out))
    return out


def dequantize(
    blocks: torch.Tensor, qtype: int, cols: int, variant: str = "native"
) -> torch.Tensor:
    rows = blocks.shape[0]
    out = torch.empty((rows, cols), dtype=torch.float32)
    load(variant).sx_dequantize(qtype, ptr(blocks.contiguous()), rows * cols, ptr(out))
    return out


def quantize_act(
    x: torch.Tensor, variant: str = "native"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float [n, k] -> (sx_act_block bytes [n, k/32, 64]: 32 signed quants then the same + 128
    as unsigned bytes, float scales [n, k/32], int32 block sums [n, k/32]) as the GEMM sees them."""
    x = x.to(torch.float32).contiguous()
    n, k = x.shape
    blocks = torch.empty((n, k // BLOCK, ACT_BLOCK_BYTES), dtype=torch.uint8)
    scales = torch.empty((n, k // BLOCK), dtype=torch.float32)
    sums = torch.empty((n, k // BLOCK), dtype=torch.int32)
    load(variant).sx_quantize_act(ptr(x), n, k, ptr(blocks), ptr(scales), ptr(sums))
    return blocks, scales, sums


def pack(
    blocks: torch.Tensor, qtype: int, rows: int, cols: int, threads: int = 1, paired: bool = False,
    variant: str = "native",
) -> torch.Tensor:  # fmt: skip
    """GGML row-major blocks -> the kernels' tiles of 8 rows (sx.h), written by the threads
    that will compute them (first touch: NUMA placement)."""
    lib = load(variant)
    out = torch.empty(lib.sx_packed_bytes(qtype, rows, cols), dtype=torch.uint8)
    lib.sx_pack(qtype, ptr(blocks.contiguous()), rows, cols, ptr(out), threads, int(paired))
    return out


def unpack(packed: torch.Tensor, qtype: int, rows: int, cols: int) -> torch.Tensor:
    """The kernels' tiles -> GGML row-major blocks (uint8 [rows, bytes per row])."""
    out = torch.empty((rows, row_bytes(qtype, cols)), dtype=torch.uint8)
    load().sx_unpack(qtype, ptr(packed), rows, cols, ptr(out))
    return out


def make_mat(
    qtype: int, data: torch.Tensor, rows: int, cols: int, bias: torch.Tensor | None
) -> SxMat:
    """A matrix descriptor (`data`: float32 rows for F32, packed tiles for Q4_0/Q8_0); it holds
    references to `data` and `bias` so they outlive it."""
    mat = SxMat(qtype, rows, cols, 0, ptr(data), ptr(bias))
    mat._keep = (data, bias)  # the struct stores raw pointers: keep the memory alive
    return mat


def quant_mat(
    qtype: int, blocks: torch.Tensor, rows: int, cols: int, bias: torch.Tensor | None = None,
    variant: str = "native",
) -> SxMat:  # fmt: skip
    """A matrix descriptor from GGML row-major blocks (packed here)."""
    return make_mat(qtype, pack(blocks, qtype, rows, cols, variant=variant), rows, cols, bias)


def gemm(
    mat: SxMat, x: torch.Tensor, threads: int, nrc: int = 0, variant: str = "native"
) -> torch.Tensor:
    """y[n, rows] = x[n, cols] @ W^T (+ bias)."""
    x = x.contiguous()
    y = torch.empty((x.shape[0], mat.rows), dtype=torch.float32)
    load(variant).sx_gemm(ctypes.byref(mat), x.shape[0], ptr(x), ptr(y), threads, nrc)
    return y
