"""Native kernels against references on random data: GGML quantization bit for bit against
gguf-py (ggml's reference rounding), the integer GEMM against exact float arithmetic on the
same quantized values, and against the float product within each format's stated bound."""

from __future__ import annotations

import sys

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from syshax.workers.cpu import lib

QTYPES = [(lib.Q8_0, T.Q8_0), (lib.Q4_0, T.Q4_0)]


def _weights(rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g)
    w[0, :32] = 0.0  # an all-zero block: d = 0, no division by zero
    w[1, :32] = 0.5  # ties for the largest magnitude: the first one wins
    w[2, 5] = 40.0  # an outlier that sets its block's scale
    return w


@pytest.mark.parametrize(("ours", "theirs"), QTYPES)
def test_weight_quantization_is_bit_exact_with_gguf(ours, theirs):
    w = _weights(48, 256, seed=1)
    blocks = lib.quantize(w, ours)
    expected = gguf.quants.quantize(w.numpy(), theirs)
    assert np.array_equal(blocks.numpy(), expected)
    back = lib.dequantize(blocks, ours, 256)
    assert np.array_equal(back.numpy(), gguf.quants.dequantize(expected, theirs))


def _quantize_act(x: torch.Tensor, variant: str = "native"):
    """(int8 quants [n, k], scales, sums) of lib.quantize_act, after checking that the unsigned
    copy the VNNI kernels read is the signed quants + 128."""
    blocks, scales, sums = lib.quantize_act(x, variant)
    signed, unsigned = blocks[..., :32], blocks[..., 32:]
    assert torch.equal(unsigned, signed ^ 0x80)
    return signed.contiguous().view(torch.int8).reshape(x.shape), scales, sums


def test_activation_quantization_matches_torch_reference():
    x = torch.randn(7, 128) * 3
    x[0, :32] = 0.0
    qs, scales, sums = _quantize_act(x)
    blocks = x.view(7, 4, 32)
    d = blocks.abs().amax(-1) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    ref = torch.round(blocks * inv[..., None])  # round half to even, like the kernels
    assert torch.equal(scales, d)
    assert torch.equal(qs.view(7, 4, 32).float(), ref)
    assert torch.equal(sums, ref.sum(-1).to(torch.int32))


def _mat(qtype: int, w: torch.Tensor) -> lib.SxMat:
    rows, cols = w.shape
    if qtype == lib.F32:
        return lib.make_mat(qtype, w.contiguous(), rows, cols, None)
    return lib.quant_mat(qtype, lib.quantize(w, qtype), rows, cols)


def _reference(mat_type: int, blocks: torch.Tensor, x: torch.Tensor, cols: int) -> torch.Tensor:
    """Exact (float64) product of the dequantized weights and the dequantized activations."""
    w = lib.dequantize(blocks, mat_type, cols).double()
    qs, scales, _ = _quantize_act(x)
    xq = (qs.double().view(x.shape[0], -1, 32) * scales.double()[..., None]).view(x.shape)
    return xq @ w.T


@pytest.mark.parametrize(("ours", "theirs"), QTYPES)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 16, 17])
def test_quantized_gemm_equals_integer_arithmetic(ours, theirs, n):
    """Integer dot products are exact; only the float accumulation of block results rounds:
    the GEMM is within 1e-5 of the exact product (relative to sum |w x|)."""
    rows, cols = 40, 192
    w = _weights(rows, cols, seed=n)
    blocks = lib.quantize(w, ours)
    bias = torch.randn(rows)
    mat = lib.quant_mat(ours, blocks, rows, cols, bias)
    x = torch.randn(n, cols)
    y = lib.gemm(mat, x, threads=2)
    exact = _reference(ours, blocks, x, cols) + bias.double()
    scale = (x.abs().double() @ lib.dequantize(blocks, ours, cols).abs().double().T) + 1.0
    assert ((y.double() - exact).abs() / scale).max() < 1e-5


@pytest.mark.parametrize(("ours", "theirs"), QTYPES)
def test_quantized_gemm_error_against_float_is_within_format_bound(ours, theirs):
    """|y - x W^T| <= sum_i |dw_i| |x_i| + |w_i| |dx_i| + |dw_i| |dx_i|, with |dw| <= d_w / 2
    per weight (Q8_0: d_w = max|w| / 127; Q4_0: d_w = max|w| / 8) and |dx| <= d_x / 2
    (d_x = max|x| / 127), per 32-element block."""
    rows, cols, n = 32, 256, 5
    w = torch.randn(rows, cols)
    x = torch.randn(n, cols)
    mat = lib.quant_mat(ours, lib.quantize(w, ours), rows, cols)
    y = lib.gemm(mat, x, threads=2)
    steps = 127 if ours == lib.Q8_0 else 8
    dw = (w.view(rows, -1, 32).abs().amax(-1) / steps / 2).repeat_interleave(32, 1)
    dx = (x.view(n, -1, 32).abs().amax(-1) / 127 / 2).repeat_interleave(32, 1)
    bound = dx @ w.abs().T + x.abs() @ dw.T + dx @ dw.T
    err = (y - x @ w.T).abs()
    assert (err <= bound * 1.001 + 1e-4).all()
    assert err.max() > 0  # the quantization is real: the product is not the float one


def test_f32_gemm_equals_torch():
    w, x, b = torch.randn(24, 96), torch.randn(3, 96), torch.randn(24)
    y = lib.gemm(lib.make_mat(lib.F32, w, 24, 96, b), x, threads=2)
    torch.testing.assert_close(y, x @ w.T + b, rtol=1e-5, atol=1e-5)


def test_gemm_into_a_given_buffer_writes_it_and_checks_its_shape():
    """`out=`: the benchmarks reuse one buffer (a fresh one of tens of MB is new pages each
    call); the product is the same, in that very tensor, and a wrong buffer is refused."""
    w, x = torch.randn(24, 96), torch.randn(3, 96)
    mat = lib.make_mat(lib.F32, w, 24, 96, None)
    out = torch.full((3, 24), float("nan"))
    y = lib.gemm(mat, x, threads=2, out=out)
    assert y.data_ptr() == out.data_ptr()
    assert torch.equal(out, lib.gemm(mat, x, threads=2))
    for bad in (torch.empty(3, 23), torch.empty(3, 24, dtype=torch.float64), torch.empty(24, 3).T):
        with pytest.raises(ValueError, match="contiguous float32"):
            lib.gemm(mat, x, threads=2, out=bad)


@pytest.mark.parametrize("qtype", [lib.F32, lib.Q8_0, lib.Q4_0])
def test_results_do_not_depend_on_batch_tile_or_threads(qtype):
    rows, cols = 37, 160  # rows not a multiple of any tile: remainder tiles run too
    w = torch.randn(rows, cols)
    mat = _mat(qtype, w)
    x = torch.randn(9, cols)
    base = lib.gemm(mat, x, threads=1)
    for nrc in (1, 2, 4, 8):  # weight rows per tile for F32, activation rows for Q4_0/Q8_0
        assert torch.equal(lib.gemm(mat, x, threads=2, nrc=nrc), base)
    singles = torch.cat([lib.gemm(mat, x[i : i + 1], threads=2) for i in range(9)])
    assert torch.equal(singles, base)


@pytest.mark.parametrize("cols", [512, 2048])  # narrow: 4 rows in one call (gemm.h SX_X2_PF)
@pytest.mark.parametrize("n", [3, 4, 5, 8, 12, 16, 27])  # 8 and more: calls of 8, 4, 2, 1
def test_q4_0_rows_equal_alone_and_in_a_batch_at_every_tile_width(n, cols):
    """Batches over 2 run Q4_0 on 16-row tiles where the build has AVX-512 VNNI (tile16.c,
    with its prefetch of later tiles), batch 1 on 8-row tiles: a row's bits are the same
    either way. 200 rows: whole pairs, a lone tile, and chunks that end mid-way."""
    rows = 200
    mat = lib.quant_mat(lib.Q4_0, lib.quantize(_weights(rows, cols, seed=n), lib.Q4_0), rows, cols)
    x = torch.randn(n, cols)
    singles = torch.cat([lib.gemm(mat, x[i : i + 1], threads=2) for i in range(n)])
    for threads in (1, 2):
        assert torch.equal(lib.gemm(mat, x, threads=threads), singles)


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split()[2:]) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


@pytest.mark.skipif(
    not {"avx512bw", "avx512_vnni"} <= _cpu_flags(), reason="needs AVX-512 BW and VNNI"
)
def test_avx512_build_has_the_16_row_q4_0_tile():
    """On an AVX-512 VNNI machine the native build takes the 16-row tiles of Q4_0, Q4_K, Q5_K
    and Q6_K (their VPDPBUSD with an embedded broadcast), so the equality tests compare two
    tiles."""
    import subprocess

    from syshax.workers.cpu import build

    dis = subprocess.run(
        ["objdump", "-d", str(build.library_path())], capture_output=True, text=True, check=True
    ).stdout
    assert any("vpdpbusd" in line and "{1to16}" in line for line in dis.splitlines())


@pytest.mark.parametrize("qtype", [lib.F32, lib.Q8_0, lib.Q4_0])
def test_portable_build_computes_the_same_bits(qtype):
    """The scalar fallback (what a machine without AVX2 runs) mirrors the SIMD lanes."""
    w = torch.randn(20, 128)
    mat = _mat(qtype, w)
    x = torch.randn(5, 128)
    assert torch.equal(lib.gemm(mat, x, threads=1, variant="portable"), lib.gemm(mat, x, threads=1))
    portable, native = _quantize_act(x, variant="portable"), _quantize_act(x)
    for ours, theirs in zip(portable, native, strict=True):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("qtype", [lib.Q8_0, lib.Q4_0])
@pytest.mark.parametrize("rows", [8, 13, 50])
def test_pack_round_trips(qtype, rows):
    """Packing into tiles of 8 rows (padded) and back gives the GGML blocks again, whatever
    the thread split (paired = gate_up's split in two halves)."""
    blocks = lib.quantize(torch.randn(rows, 64), qtype)
    for threads, paired in ((1, False), (2, False), (2, rows % 16 == 0)):
        packed = lib.pack(blocks, qtype, rows, 64, threads, paired)
        assert packed.numel() == -(-rows // 8) * 8 * lib.row_bytes(qtype, 64)
        assert torch.equal(lib.unpack(packed, qtype, rows, 64), blocks)


def test_rmsnorm_and_softmax_match_torch():
    x, w = torch.randn(576), torch.randn(576)
    out = torch.empty(576)
    lib.load().sx_rmsnorm(lib.ptr(x), lib.ptr(w), 576, 1e-5, lib.ptr(out))
    ref = w * (x * torch.rsqrt(x.pow(2).mean() + 1e-5))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    for n in (1, 7, 8, 100, 1000):
        s = torch.randn(n) * 20
        ref = torch.softmax(s, 0)
        lib.load().sx_softmax_inplace(lib.ptr(s), n)
        torch.testing.assert_close(s, ref, rtol=2e-6, atol=1e-7)


def _vm_flags(addr: int) -> list[str]:
    """The VmFlags of the mapping that holds `addr` (Linux /proc/self/smaps)."""
    flags, inside = [], False
    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "VmFlags:":
                flags = line.split()[1:]
    return flags


def test_packed_weights_sit_in_huge_page_aligned_buffers_and_pack_the_same():
    """Large packed matrices go into 2 MiB aligned buffers, first touched on small pages (fast
    on a VM) and advised for transparent huge pages once filled (khugepaged collapses them
    later: fewer TLB misses when a decode step streams them); the packed bytes do not change."""
    rows, cols = 8192, 512  # 2.25 MiB of Q4_0 blocks packed: over one huge page
    blocks = torch.randint(0, 256, (rows, lib.row_bytes(lib.Q4_0, cols)), dtype=torch.uint8)
    size = lib.packed_bytes(lib.Q4_0, rows, cols)
    assert size >= lib.HUGE_PAGE
    buf = lib.weight_buffer(size)
    assert buf.numel() == size and buf.dtype == torch.uint8
    assert buf.data_ptr() % lib.HUGE_PAGE == 0
    plain = lib.pack(blocks, lib.Q4_0, rows, cols, 2, out=torch.empty(size, dtype=torch.uint8))
    assert torch.equal(lib.pack(blocks, lib.Q4_0, rows, cols, 2, out=buf), plain)
    if sys.platform == "linux":
        assert lib.advise_huge_pages(buf)
        assert "hg" in _vm_flags(buf.data_ptr())
    assert torch.equal(buf, plain)
    assert torch.equal(lib.pack(blocks, lib.Q4_0, rows, cols, 2), plain)  # default buffer
    small = lib.weight_buffer(100)
    assert small.numel() == 100
    assert not lib.advise_huge_pages(small)  # no whole huge page in it


def test_eager_weight_buffers_are_advised_before_the_pack_touches_them(monkeypatch):
    """SYSHAX_HUGE_PAGES=eager (a worker's default): weight_buffer advises the buffer for huge
    pages before returning it, i.e. before the pack writes it, so the first touch takes 2 MiB
    pages; lazy (the default elsewhere) leaves the advice to the loader, after the pack. (Not
    read back from the mapping's flags for lazy: freed memory that an earlier advice covered
    can come back in the next buffer with its flag.)"""
    advised = []
    real = lib.advise_huge_pages
    monkeypatch.setattr(
        lib, "advise_huge_pages", lambda buf: advised.append(buf.data_ptr()) or real(buf)
    )
    size = 3 * lib.HUGE_PAGE
    monkeypatch.setenv("SYSHAX_HUGE_PAGES", "lazy")
    for eager, env_value, expect in ((True, "lazy", True), (False, "eager", False), (None, "eager", True), (None, "lazy", False)):  # fmt: skip
        monkeypatch.setenv("SYSHAX_HUGE_PAGES", env_value)
        advised.clear()
        buf = lib.weight_buffer(size, eager=eager)
        assert advised == ([buf.data_ptr()] if expect else []), (eager, env_value)
        if expect and sys.platform == "linux":
            assert "hg" in _vm_flags(buf.data_ptr())
    monkeypatch.delenv("SYSHAX_HUGE_PAGES")
    advised.clear()
    lib.weight_buffer(size)
    assert advised == []  # unset: lazy
    lib.weight_buffer(100, eager=True)
    assert advised == []  # a small buffer is an ordinary one
