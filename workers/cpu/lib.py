"""ctypes bindings of the native CPU kernels (workers/cpu/native/sx.h), loaded once per variant.

The structs mirror sx.h field for field. Functions take raw pointers: callers pass contiguous
torch tensors (`ptr(t)`) and keep them alive for as long as the kernels may read them.
"""

from __future__ import annotations

import ctypes
import functools
import math
from ctypes import POINTER, c_char_p, c_float, c_int, c_int32, c_int64, c_void_p

import torch
from syshax.shared import env

from .build import library_path

# ggml's GGMLQuantizationType numbers.
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = 0, 1, 2, 3, 6, 7, 8, 12, 13, 14
STACK = -1  # SxMat.type of a row-stack of parts (stack_mats)
QTYPES = {"q4_0": Q4_0, "q8_0": Q8_0}  # what float weights can be quantized to (requantization)
BLOCK = 32
BLOCK_ELEMS = {
    F32: 1,
    F16: 1,
    Q4_0: 32,
    Q4_1: 32,
    Q5_0: 32,
    Q5_1: 32,
    Q8_0: 32,
    Q4_K: 256,
    Q5_K: 256,
    Q6_K: 256,
}
BLOCK_BYTES = {
    F32: 4,
    F16: 2,
    Q4_0: 18,
    Q4_1: 20,
    Q5_0: 22,
    Q5_1: 24,
    Q8_0: 34,
    Q4_K: 144,
    Q5_K: 176,
    Q6_K: 210,
}
# Weight types the GEMM and the fused step take as stored (packed, no float copy, no
# requantization); dequantize / dequantize_rows take every type in BLOCK_BYTES.
NATIVE_TYPES = frozenset({F32, F16, Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K})
# Embedding tables the fused step (sx_model.embed_type) and dequantize_rows read as stored.
EMBED_TYPES = frozenset(BLOCK_BYTES)
_NAMES = {F32: "f32", F16: "f16", Q4_0: "q4_0", Q4_1: "q4_1", Q5_0: "q5_0", Q5_1: "q5_1",
          Q8_0: "q8_0", Q4_K: "q4_k", Q5_K: "q5_k", Q6_K: "q6_k", STACK: "stack"}  # fmt: skip
ACT_BLOCK_BYTES = 64  # sx_act_block: 32 signed quants + the same as unsigned


class SxMat(ctypes.Structure):
    _fields_ = [
        ("type", c_int32),
        ("rows", c_int32),
        ("cols", c_int32),
        ("n_parts", c_int32),
        ("data", c_void_p),
        ("bias", c_void_p),
        ("parts", c_void_p),  # const SxMat * (stack_mats)
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
        ("kv_type", c_int32),  # F32, F16 or Q8_0 rows (kv_type_of)
        ("eps", c_float),
        ("embed", c_void_p),
        ("final_norm", c_void_p),
        ("lm_head", SxMat),
        ("rope_cos", c_void_p),
        ("rope_sin", c_void_p),
        ("layers", POINTER(SxLayer)),
        ("embed_type", c_int32),  # F32 (default), F16 or any type in BLOCK_BYTES, as stored
        ("embed_pad_", c_int32),
        ("embed_row_bytes", c_int64),  # 0: row_bytes(embed_type, hidden)
        ("block_size", c_int32),  # KV positions per block; 0: max_len (n_slots unpaged slots)
        ("block_pad_", c_int32),
    ]


_SIGNATURES = {
    "sx_simd": (c_char_p, []),
    "sx_max_threads": (c_int, []),
    "sx_amx_enable": (c_int, [c_int]),
    "sx_amx_active": (c_int, []),
    "sx_quantize": (None, [c_int, c_void_p, c_int64, c_void_p]),
    "sx_dequantize": (None, [c_int, c_void_p, c_int64, c_void_p]),
    "sx_dequantize_rows": (None, [c_int, c_void_p, c_int64, c_int, c_void_p, c_int, c_void_p]),
    "sx_block_elems": (c_int, [c_int]),
    "sx_row_bytes": (ctypes.c_size_t, [c_int, c_int64]),
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
    "sx_step": (
        c_int,
        [c_void_p, c_int, c_void_p, c_void_p, c_void_p, c_void_p, c_int, c_int, c_void_p, c_void_p],
    ),
    "sx_prof_read": (c_int, [c_void_p, c_void_p, c_int]),
    "sx_prof_tsc": (ctypes.c_uint64, []),
    "sx_rmsnorm": (None, [c_void_p, c_void_p, c_int, c_float, c_void_p]),
    "sx_softmax_inplace": (None, [c_void_p, c_int]),
    "sx_attend_heads_paged": (
        None,
        [
            c_void_p,
            c_int,
            c_void_p,
            c_void_p,
            c_int,
            c_void_p,
            c_int,
            ctypes.c_size_t,
            ctypes.c_size_t,
            c_int,
            c_void_p,
            c_void_p,
            c_int,
            c_float,
            c_void_p,
            ctypes.c_size_t,
            c_void_p,
        ],
    ),  # fmt: skip
}


@functools.cache
def load(variant: str = "native") -> ctypes.CDLL:
    """The kernels library (compiled on first use, see build.py)."""
    lib = ctypes.CDLL(str(library_path(variant)))
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    lib.sx_amx_enable(int(env.amx()))  # before any step: it asks Linux for the tile state
    return lib


def ptr(t: torch.Tensor | None) -> int | None:
    if t is None:
        return None
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("native kernels need contiguous CPU tensors")
    return t.data_ptr()


def attend_heads(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    group: int,
    cached: int,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    scores: torch.Tensor,
    out: torch.Tensor,
    variant: str = "native",
) -> None:
    """The fused step's attention (sx_attend_heads_paged) on tensors: query heads q [heads, d]
    of KV head `group` over `cached` positions of a paged cache [blocks, kv_heads, block_size,
    row] (float16 or float32 rows of d, or uint8 rows of Q8_0 blocks) with block table `table`
    (int32), then the new key and value (d floats each); scores: float32 scratch [heads, >=
    cached + 1]; out: float32 [heads, d]."""
    _, kv_heads, bs, _ = k_cache.shape
    d = q.shape[1]
    load(variant).sx_attend_heads_paged(
        ptr(q), q.shape[0], ptr(k_cache), ptr(v_cache), kv_type_of(k_cache.dtype),
        ptr(table), bs, kv_heads * bs * d, group * bs * d, cached, ptr(k_new), ptr(v_new), d,
        1.0 / math.sqrt(d), ptr(scores), scores.shape[1], ptr(out),
    )  # fmt: skip


def kv_type_of(storage: torch.dtype) -> int:
    """The kernels' KV row type of a cache tensor's dtype: F32, F16, or Q8_0 (uint8 rows of
    Q8_0 blocks: workers/engine/kv_cache.py)."""
    kinds = {torch.float32: F32, torch.float16: F16, torch.uint8: Q8_0}
    if storage not in kinds:
        raise ValueError(f"the kernels read float32, float16 or Q8_0 KV caches, not {storage}")
    return kinds[storage]


def type_name(qtype: int) -> str:
    """'q4_k' for Q4_K etc. (ggml's names, lower case); 'type N' for one the kernels lack."""
    return _NAMES.get(int(qtype), f"type {int(qtype)}")


def block_size(qtype: int) -> int:
    """The column multiple a matrix of `qtype` needs: 256 for K-quants, else 32 (the
    activations' 8-bit blocks)."""
    if qtype not in BLOCK_BYTES:
        raise ValueError(f"unknown weight type {qtype}")
    return max(BLOCK, BLOCK_ELEMS[qtype])


def _check_cols(qtype: int, cols: int) -> None:
    if qtype in (F32, F16):  # float rows: checked where the activations are blocked
        return
    if cols % block_size(qtype):
        kind = "K-quant super-block" if BLOCK_ELEMS[qtype] == 256 else "block"
        raise ValueError(
            f"{cols} columns is not a multiple of the {block_size(qtype)}-weight {kind} "
            f"(weight type {qtype})"
        )


def row_bytes(qtype: int, cols: int) -> int:
    return cols // BLOCK_ELEMS[qtype] * BLOCK_BYTES[qtype]


def quantize(x: torch.Tensor, qtype: int, variant: str = "native") -> torch.Tensor:
    """Float [rows, cols] -> GGML blocks as uint8 [rows, bytes per row] (ggml's reference;
    qtype F32, Q4_0 or Q8_0)."""
    if qtype not in (F32, Q4_0, Q8_0):
        raise ValueError(f"quantize makes F32, Q4_0 or Q8_0 blocks, not type {qtype}")
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
    """GGML row-major blocks (any type in BLOCK_BYTES) -> float32 [rows, cols], bit for bit
    gguf-py's dequantize."""
    if cols % BLOCK_ELEMS[qtype]:
        raise ValueError(f"{cols} columns is not a multiple of type {qtype}'s block")
    blocks = blocks.contiguous()
    rows = blocks.numel() * BLOCK_ELEMS[qtype] // BLOCK_BYTES[qtype] // cols
    out = torch.empty((rows, cols), dtype=torch.float32)
    load(variant).sx_dequantize(qtype, ptr(blocks), rows * cols, ptr(out))
    return out


def dequantize_rows(table, qtype: int, cols: int, row_ids, variant: str = "native") -> torch.Tensor:
    """float32 [len(row_ids), cols]: rows `row_ids` of a row-major table of `qtype` (a torch
    tensor or a numpy array, e.g. a memmap of a GGUF tensor, of shape [rows, ...] whose rows are
    each contiguous): only those rows are read, nothing of the table is copied."""
    if qtype not in BLOCK_BYTES or cols % BLOCK_ELEMS[qtype]:
        raise ValueError(f"cannot read rows of {cols} columns of type {qtype}")
    need = row_bytes(qtype, cols)
    if isinstance(table, torch.Tensor):
        if table.device.type != "cpu" or table.dim() < 1:
            raise ValueError("dequantize_rows needs a CPU table")
        rows, base = table.shape[0], table.data_ptr()
        stride = table.stride(0) * table.element_size() if table.dim() > 1 else need
        inner = table[0].is_contiguous() if rows else True
        have = table[0].numel() * table.element_size() if table.dim() > 1 else table.numel()
    else:
        import numpy as np

        arr = np.asarray(table)
        rows, base = arr.shape[0], arr.ctypes.data
        stride = arr.strides[0] if arr.ndim > 1 else need
        inner = arr[0].flags.c_contiguous if rows and arr.ndim > 1 else True
        have = arr[0].nbytes if arr.ndim > 1 else arr.nbytes
    if not inner or have < need:
        raise ValueError(f"each table row must hold {need} contiguous bytes")
    ids = torch.as_tensor(row_ids, dtype=torch.int64).reshape(-1).contiguous()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= rows):
        raise IndexError(f"row ids out of range [0, {rows})")
    out = torch.empty((ids.numel(), cols), dtype=torch.float32)
    load(variant).sx_dequantize_rows(qtype, base, stride, cols, ptr(ids), ids.numel(), ptr(out))
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


HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # Linux


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def weight_buffer(nbytes: int, eager: bool | None = None) -> torch.Tensor:
    """An uninitialised uint8 buffer for packed weights, 2 MiB aligned, so that its whole huge
    pages can be backed by transparent huge pages (`advise_huge_pages`). When that advice is
    given is SYSHAX_HUGE_PAGES (`eager` overrides it):

    - lazy (default): after the pack, which first touches the buffer on ordinary 4 KiB pages;
      khugepaged collapses them later, at its pace (by default 16 MB per 10 s). On a VM fresh
      2 MiB pages come from never-touched guest memory and each 4 KiB of it costs the host a
      fault on first touch: advising before the pack made the 1B Q4_K_M load 0.7-1.1 s
      instead of 0.4-0.5 s (2-core Zen 4 VM, alternating runs).
    - eager: before, so the pack's first touch already takes 2 MiB pages. Batch-1 decode
      gained 3-7% in those runs; and on 4 KiB pages the speed depends on where the pages land:
      one 1B Q4_0 file loaded twice into one process streamed 5-8% slower in the copy loaded
      first, in every order tried, and equally fast in both with huge pages at first touch
      (docs/benchmarks.md, 2026-12-07).

    Small buffers are ordinary ones."""
    if nbytes < HUGE_PAGE or _libc() is None:
        return torch.empty(nbytes, dtype=torch.uint8)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    buf = raw[start : start + nbytes]  # the view keeps the whole allocation alive
    if (env.huge_pages() == "eager") if eager is None else eager:
        advise_huge_pages(buf)
    return buf


def advise_huge_pages(buf: torch.Tensor) -> bool:
    """Advise MADV_HUGEPAGE over the whole 2 MiB pages of an already filled buffer: where
    transparent huge pages are allowed (`enabled` = always or madvise), the kernel's khugepaged
    then collapses them into huge pages in the background (a decode step streams every weight,
    and huge pages cut its TLB misses ~500x), without the first-touch cost in the load. Returns
    whether the advice was taken (False off Linux, for small buffers, or on an error)."""
    libc = _libc()
    start = -buf.data_ptr() % HUGE_PAGE
    length = (buf.numel() * buf.element_size() - start) // HUGE_PAGE * HUGE_PAGE
    if libc is None or length <= 0:
        return False
    addr = c_void_p(buf.data_ptr() + start)
    return libc.madvise(addr, ctypes.c_size_t(length), _MADV_HUGEPAGE) == 0


def packed_bytes(qtype: int, rows: int, cols: int) -> int:
    """Bytes of a `rows` x `cols` matrix of `qtype` in the kernels' packed layout."""
    return int(load().sx_packed_bytes(qtype, rows, cols))


def pack(
    blocks: torch.Tensor, qtype: int, rows: int, cols: int, threads: int = 1, paired: bool = False,
    variant: str = "native", out: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """GGML row-major blocks -> the kernels' tiles of 8 rows (sx.h), written by the threads
    that will compute them (first touch: NUMA placement). F32/F16: the rows as they are.
    `out`: a uint8 tensor of `packed_bytes` to write into (e.g. a slice of a bigger buffer:
    matrices of 8-row multiples stacked by rows pack part by part into one buffer)."""
    if qtype not in NATIVE_TYPES:
        raise ValueError(f"the kernels do not take weight type {qtype} as stored")
    _check_cols(qtype, cols)
    blocks = blocks.contiguous()
    if blocks.numel() * blocks.element_size() < rows * row_bytes(qtype, cols):
        raise ValueError(f"{rows} rows of type {qtype} need {rows * row_bytes(qtype, cols)} bytes")
    lib = load(variant)
    size = lib.sx_packed_bytes(qtype, rows, cols)
    if out is None:
        out = torch.empty(size, dtype=torch.uint8)
    elif out.dtype != torch.uint8 or out.numel() != size:
        raise ValueError(f"out must be {size} uint8 bytes, got {out.numel()} {out.dtype}")
    lib.sx_pack(qtype, ptr(blocks), rows, cols, ptr(out), threads, int(paired))
    return out


def unpack(packed: torch.Tensor, qtype: int, rows: int, cols: int) -> torch.Tensor:
    """The kernels' tiles -> GGML row-major blocks (uint8 [rows, bytes per row])."""
    out = torch.empty((rows, row_bytes(qtype, cols)), dtype=torch.uint8)
    load().sx_unpack(qtype, ptr(packed), rows, cols, ptr(out))
    return out


def make_mat(
    qtype: int, data: torch.Tensor, rows: int, cols: int, bias: torch.Tensor | None
) -> SxMat:
    """A matrix descriptor (`data`: float32 / float16 rows for F32 / F16, packed tiles for the
    block types); it holds references to `data` and `bias` so they outlive it."""
    if qtype not in NATIVE_TYPES:
        raise ValueError(f"the kernels do not take weight type {qtype} as stored")
    _check_cols(qtype, cols)
    mat = SxMat(qtype, rows, cols, 0, ptr(data), ptr(bias), None)
    mat._keep = (data, bias)  # the struct stores raw pointers: keep the memory alive
    return mat


def stack_mats(mats: list[SxMat]) -> SxMat:
    """One matrix whose rows are those of `mats` in order (e.g. q/k/v parts of different
    types): sx_gemm and the fused step treat it as one. Every part but the last needs a
    multiple of 8 rows, all the same columns; each part keeps its own bias. The result keeps
    the parts (and their memory) alive; keep it alive while the kernels may read it."""
    if not mats:
        raise ValueError("stack_mats needs at least one matrix")
    cols = mats[0].cols
    for i, m in enumerate(mats):
        if m.type == STACK or m.n_parts:
            raise ValueError("a stack's part cannot itself be a stack")
        if m.cols != cols:
            raise ValueError(f"part {i} has {m.cols} columns, part 0 has {cols}")
        if i < len(mats) - 1 and m.rows % 8:
            raise ValueError(
                f"part {i} has {m.rows} rows: every part but the last needs a multiple of 8"
            )
    parts = (SxMat * len(mats))(*mats)
    mat = SxMat(
        STACK, sum(m.rows for m in mats), cols, len(mats), None, None, ctypes.addressof(parts)
    )
    mat._keep = (parts, tuple(mats))  # the parts' memory lives as long as their descriptors
    return mat


def quant_mat(
    qtype: int, blocks: torch.Tensor, rows: int, cols: int, bias: torch.Tensor | None = None,
    variant: str = "native",
) -> SxMat:  # fmt: skip
    """A matrix descriptor from GGML row-major blocks (packed here)."""
    return make_mat(qtype, pack(blocks, qtype, rows, cols, variant=variant), rows, cols, bias)


def gemm(
    mat: SxMat,
    x: torch.Tensor,
    threads: int,
    nrc: int = 0,
    variant: str = "native",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """y[n, rows] = x[n, cols] @ W^T (+ bias), into `out` when given (a benchmark's reused
    buffer: a fresh one of tens of MB is new pages each call, whose faults it would time)."""
    x = x.contiguous()
    y = torch.empty((x.shape[0], mat.rows), dtype=torch.float32) if out is None else out
    if y.shape != (x.shape[0], mat.rows) or y.dtype != torch.float32 or not y.is_contiguous():
        raise ValueError(f"out must be a contiguous float32 tensor of {(x.shape[0], mat.rows)}")
    load(variant).sx_gemm(ctypes.byref(mat), x.shape[0], ptr(x), ptr(y), threads, nrc)
    return y
