"""GGUF blocks the kernels take as stored (F16, Q4_1, and the K-quants of Q4_K_M / Q5_K_M
files): dequantization bit for bit gguf-py's, packing as a byte permutation, the integer GEMM
against exact arithmetic, bit-identical builds and batch splits, row-stacks of parts of
different types, and embedding rows read from blocks in the fused step."""

from __future__ import annotations

import ctypes

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from syshax.workers.cpu import lib

GEMM_TYPES = [lib.F16, lib.Q4_1, lib.Q4_K, lib.Q5_K, lib.Q6_K, lib.Q4_0, lib.Q8_0]
ALL_TYPES = GEMM_TYPES + [lib.Q5_0, lib.Q5_1]
# Byte offsets of each block's fp16 scale fields (random bytes there could be inf / nan).
F16_FIELDS = {lib.Q4_0: (0,), lib.Q8_0: (0,), lib.Q5_0: (0,), lib.Q4_1: (0, 2), lib.Q5_1: (0, 2),
              lib.Q4_K: (0, 2), lib.Q5_K: (0, 2), lib.Q6_K: (208,)}  # fmt: skip


def random_blocks(qtype: int, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """uint8 [rows, row bytes]: random quants and scales, finite fp16 fields."""
    rng = np.random.default_rng(seed)
    if qtype == lib.F16:
        return torch.from_numpy(rng.standard_normal((rows, cols)).astype(np.float16).view(np.uint8))
    nb, bb = cols // lib.BLOCK_ELEMS[qtype], lib.BLOCK_BYTES[qtype]
    b = rng.integers(0, 256, size=(rows, nb, bb), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        d = (rng.standard_normal((rows, nb)) * 0.01).astype(np.float16)
        b[..., off : off + 2] = d.view(np.uint8).reshape(rows, nb, 2)
    return torch.from_numpy(b.reshape(rows, nb * bb))


def reference(blocks: torch.Tensor, qtype: int, cols: int) -> np.ndarray:
    return gguf.quants.dequantize(blocks.numpy(), T(qtype)).reshape(-1, cols).astype(np.float32)


def mat_of(qtype: int, blocks: torch.Tensor, rows: int, cols: int, bias=None, threads=1):
    return lib.make_mat(qtype, lib.pack(blocks, qtype, rows, cols, threads), rows, cols, bias)


@pytest.mark.parametrize("qtype", ALL_TYPES)
def test_dequantize_is_bit_exact_with_gguf(qtype):
    blocks = random_blocks(qtype, 6, 512, seed=qtype)
    ours = lib.dequantize(blocks, qtype, 512).numpy()
    assert np.array_equal(ours.view(np.uint32), reference(blocks, qtype, 512).view(np.uint32))
    # Rows of a table, read in place (a numpy memmap of a GGUF tensor works the same).
    ids = [5, 0, 5, 2]
    rows = lib.dequantize_rows(blocks.numpy(), qtype, 512, ids)
    assert torch.equal(rows, torch.from_numpy(ours[ids]))
    assert torch.equal(lib.dequantize_rows(blocks, qtype, 512, ids), rows)


def test_dequantize_rows_reads_a_memmap_with_a_row_stride(tmp_path):
    blocks = random_blocks(lib.Q6_K, 9, 256)
    wide = np.zeros((9, blocks.shape[1] + 6), dtype=np.uint8)  # rows further apart than needed
    wide[:, : blocks.shape[1]] = blocks.numpy()
    wide.tofile(tmp_path / "t.bin")
    mm = np.memmap(tmp_path / "t.bin", dtype=np.uint8, mode="r", shape=wide.shape)
    got = lib.dequantize_rows(mm[:, : blocks.shape[1]], lib.Q6_K, 256, [8, 3])
    assert torch.equal(got, lib.dequantize(blocks, lib.Q6_K, 256)[[8, 3]])
    with pytest.raises(IndexError):
        lib.dequantize_rows(mm, lib.Q6_K, 256, [9])


@pytest.mark.parametrize("qtype", GEMM_TYPES)
@pytest.mark.parametrize("rows", [8, 13, 40])
def test_pack_round_trips(qtype, rows):
    blocks = random_blocks(qtype, rows, 512, seed=rows)
    for threads, paired in ((1, False), (2, False), (2, rows % 16 == 0)):
        packed = lib.pack(blocks, qtype, rows, 512, threads, paired)
        assert torch.equal(lib.unpack(packed, qtype, rows, 512), blocks)


def test_packed_bytes_per_weight():
    """K-quant tiles stay close to the file's size (sx.h states the layouts)."""
    per_weight = {t: lib.load().sx_packed_bytes(t, 8, 256) / 2048 for t in GEMM_TYPES}
    assert per_weight[lib.Q4_K] == 1184 / 2048 and per_weight[lib.Q5_K] == 1440 / 2048
    assert per_weight[lib.Q6_K] == 210 / 256 and per_weight[lib.Q4_1] == 20 / 32
    assert per_weight[lib.F16] == 2


def test_columns_must_fill_super_blocks():
    with pytest.raises(ValueError, match="multiple of the 256-weight K-quant super-block"):
        lib.pack(random_blocks(lib.Q4_K, 8, 256)[:, :72], lib.Q4_K, 8, 128)
    assert lib.block_size(lib.Q6_K) == 256 and lib.block_size(lib.Q4_1) == 32
    assert lib.row_bytes(lib.Q4_K, 512) == 288 and lib.row_bytes(lib.F16, 64) == 128
    assert lib.QTYPES == {"q4_0": lib.Q4_0, "q8_0": lib.Q8_0}


def _exact(qtype: int, blocks: torch.Tensor, x: torch.Tensor, cols: int) -> torch.Tensor:
    """float64 product of the dequantized weights and the activations the kernel sees (the
    dequantized 8-bit blocks; F16 weights meet the float activations)."""
    w = torch.from_numpy(reference(blocks, qtype, cols)).double()
    if qtype == lib.F16:
        return x.double() @ w.T, x.double().abs() @ w.abs().T
    act, scales, _ = lib.quantize_act(x)
    qs = act[..., :32].contiguous().view(torch.int8).double()
    xq = (qs * scales.double()[..., None]).reshape(x.shape)
    return xq @ w.T, xq.abs() @ w.abs().T


@pytest.mark.parametrize("qtype", GEMM_TYPES)
@pytest.mark.parametrize("n", [1, 3, 16])
def test_gemm_equals_exact_arithmetic(qtype, n):
    rows, cols = 24, 512
    blocks = random_blocks(qtype, rows, cols, seed=n)
    bias = torch.randn(rows)
    x = torch.randn(n, cols) * 2
    y = lib.gemm(mat_of(qtype, blocks, rows, cols, bias), x, threads=2)
    exact, scale = _exact(qtype, blocks, x, cols)
    assert ((y.double() - exact - bias.double()).abs() / (scale + 1.0)).max() < 1e-5


@pytest.mark.parametrize("qtype", GEMM_TYPES)
@pytest.mark.parametrize("rows", [37, 200])  # a remainder tile; 16-row pairs (tile16.c)
def test_results_do_not_depend_on_batch_tile_threads_or_build(qtype, rows):
    cols = 512
    mat = mat_of(qtype, random_blocks(qtype, rows, cols, seed=7), rows, cols, torch.randn(rows))
    x = torch.randn(27, cols)  # several calls per 16-row tile, and a remainder of 2 + 1 rows
    base = lib.gemm(mat, x, threads=1)
    for nrc in (1, 2, 4, 8):
        assert torch.equal(lib.gemm(mat, x, threads=2, nrc=nrc), base)
    assert torch.equal(torch.cat([lib.gemm(mat, x[i : i + 1], threads=2) for i in range(27)]), base)
    assert torch.equal(lib.gemm(mat, x, threads=2, variant="portable"), base)


def test_stack_equals_its_parts():
    """q (Q4_K) / k (Q4_K) / v (Q6_K) as Q4_K_M stores them, plus Q4_1 and F32 parts, with
    biases: one GEMM over the stack gives each part's own results, for any thread split."""
    cols = 512
    specs = [
        (lib.Q4_K, 48),
        (lib.Q4_K, 16),
        (lib.Q6_K, 24),
        (lib.Q4_1, 8),
        (lib.F32, 8),
        (lib.Q4_0, 13),
    ]
    parts = []
    for i, (qtype, rows) in enumerate(specs):
        bias = torch.randn(rows) if i % 2 else None
        if qtype == lib.F32:
            parts.append(lib.make_mat(lib.F32, torch.randn(rows, cols), rows, cols, bias))
        else:
            parts.append(mat_of(qtype, random_blocks(qtype, rows, cols, seed=i), rows, cols, bias))
    stack = lib.stack_mats(parts)
    del parts[1:]  # the stack keeps its parts alive
    assert stack.rows == sum(r for _, r in specs)
    x = torch.randn(5, cols)
    expected = torch.cat([lib.gemm(p, x, threads=1) for p in stack._keep[1]], dim=1)
    for threads in (1, 2, 3, 5):
        assert torch.equal(lib.gemm(stack, x, threads=threads), expected)
    assert torch.equal(lib.gemm(stack, x, threads=2, variant="portable"), expected)
    with pytest.raises(ValueError, match="multiple of 8"):
        lib.stack_mats([stack._keep[1][5], stack._keep[1][0]])


# ---- the fused step ----------------------------------------------------------------------

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, MAX_LEN, SLOTS = 256, 4, 2, 64, 512, 40, 16, 3


class TinyModel:
    """A one-layer model described to the kernels by hand, weights as GGUF blocks."""

    def __init__(self, qkv: lib.SxMat, gate_up: lib.SxMat, embed, embed_type: int, seed=0):
        g = torch.Generator().manual_seed(seed)
        rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
        self.keep = [qkv, gate_up, embed]
        norm = lambda: 1 + 0.1 * rnd(HIDDEN)  # noqa: E731
        t = torch.arange(MAX_LEN)[:, None] / 10000 ** (torch.arange(HEAD_DIM // 2) * 2 / HEAD_DIM)
        cos, sin = torch.cat([t.cos(), t.cos()], 1), torch.cat([t.sin(), t.sin()], 1)
        kv = torch.zeros(2, SLOTS, KV_HEADS, MAX_LEN, HEAD_DIM)
        f32 = [norm(), norm(), norm(), cos.contiguous(), sin.contiguous(), kv]
        self.keep += f32
        o = mat_of(
            lib.Q4_K,
            random_blocks(lib.Q4_K, HIDDEN, HEADS * HEAD_DIM, seed=11),
            HIDDEN,
            HEADS * HEAD_DIM,
        )
        down = mat_of(lib.Q6_K, random_blocks(lib.Q6_K, HIDDEN, INTER, seed=12), HIDDEN, INTER)
        head = lib.make_mat(lib.F32, rnd(VOCAB, HIDDEN) * 0.1, VOCAB, HIDDEN, None)
        self.keep += [o, down, head]
        self.layers = (lib.SxLayer * 1)()
        self.layers[0] = lib.SxLayer(
            attn_norm=f32[0].data_ptr(), ffn_norm=f32[1].data_ptr(), qkv=qkv, o=o,
            gate_up=gate_up, down=down, k_cache=kv[0].data_ptr(), v_cache=kv[1].data_ptr(),
        )  # fmt: skip
        self.desc = lib.SxModel(
            n_layers=1, hidden=HIDDEN, n_heads=HEADS, n_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
            inter=INTER, vocab=VOCAB, max_len=MAX_LEN, n_slots=SLOTS, kv_type=0, eps=1e-5,
            embed=embed.data_ptr(), final_norm=f32[2].data_ptr(), lm_head=head,
            rope_cos=f32[3].data_ptr(), rope_sin=f32[4].data_ptr(), layers=self.layers,
            embed_type=embed_type,
        )  # fmt: skip
        self.ctx = lib.load().sx_ctx_new(ctypes.byref(self.desc), SLOTS, 2, 0)
        assert self.ctx

    def run(self, steps) -> list[torch.Tensor]:
        out = []
        for tokens, positions in steps:
            logits = torch.empty(len(tokens), VOCAB)
            tok, pos = torch.tensor(tokens), torch.tensor(positions)
            rc = lib.load().sx_decode(
                self.ctx, len(tokens), tok.data_ptr(), pos.data_ptr(), logits.data_ptr()
            )
            assert rc == 0
            out.append(logits)
        lib.load().sx_ctx_free(self.ctx)
        return out


STEPS = [([3, 7, 39], [0, 0, 0]), ([1, 0, 7], [1, 1, 1]), ([22, 5, 5], [2, 2, 2])]


def _qkv_parts(split_q: bool = False) -> list[lib.SxMat]:
    """q, k: Q4_K; v: Q6_K (a Q4_K_M layer); `split_q`: q in two Q4_K parts (same bytes)."""
    q = random_blocks(lib.Q4_K, HEADS * HEAD_DIM, HIDDEN, seed=1)
    k = random_blocks(lib.Q4_K, KV_HEADS * HEAD_DIM, HIDDEN, seed=2)
    v = random_blocks(lib.Q6_K, KV_HEADS * HEAD_DIM, HIDDEN, seed=3)
    qs = [q[:104], q[104:]] if split_q else [q]
    return [mat_of(lib.Q4_K, b, b.shape[0], HIDDEN) for b in qs] + [
        mat_of(lib.Q4_K, k, k.shape[0], HIDDEN, torch.linspace(-1, 1, k.shape[0])),
        mat_of(lib.Q6_K, v, v.shape[0], HIDDEN),
    ]


def _gate_up() -> lib.SxMat:
    gate = random_blocks(lib.Q5_K, INTER, HIDDEN, seed=4)
    up = random_blocks(lib.Q6_K, INTER, HIDDEN, seed=5)
    return lib.stack_mats(
        [mat_of(lib.Q5_K, gate, INTER, HIDDEN), mat_of(lib.Q6_K, up, INTER, HIDDEN)]
    )


@pytest.mark.parametrize("etype", [lib.F16, lib.Q8_0, lib.Q4_1, lib.Q5_0, lib.Q4_K, lib.Q6_K])
def test_fused_step_reads_embedding_blocks_as_stored(etype):
    """Embedding rows dequantized from the table in the step: the same logits, bit for bit, as
    a float32 table holding the dequantized rows; stacks split anywhere compute the same."""
    table = random_blocks(etype, VOCAB, HIDDEN, seed=9)
    floats = lib.dequantize(table, etype, HIDDEN)
    ref = TinyModel(lib.stack_mats(_qkv_parts()), _gate_up(), floats, lib.F32).run(STEPS)
    got = TinyModel(lib.stack_mats(_qkv_parts(split_q=True)), _gate_up(), table, etype).run(STEPS)
    for a, b in zip(ref, got, strict=True):
        assert torch.isfinite(a).all() and a.abs().max() > 0
        assert torch.equal(a, b)


def test_fused_stack_matches_float_weights():
    """A Q4_K_M-like layer (stacked q/k/v of Q4_K and Q6_K, gate Q5_K / up Q6_K) against the
    same step with float32 copies of the dequantized weights: equal within the activations'
    8-bit quantization noise. Seeded: a bound on rounding noise holds for typical inputs, and
    an unseeded draw made the test fail now and then."""
    emb = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(0))
    quant = TinyModel(lib.stack_mats(_qkv_parts()), _gate_up(), emb, lib.F32).run(STEPS)

    def f32_of(m: lib.SxMat) -> lib.SxMat:
        w = lib.dequantize(lib.unpack(m._keep[0], m.type, m.rows, m.cols), m.type, m.cols)
        return lib.make_mat(lib.F32, w, m.rows, m.cols, m._keep[1])

    qkv_f = lib.stack_mats([f32_of(m) for m in _qkv_parts()])
    gu_f = lib.stack_mats([f32_of(m) for m in _gate_up()._keep[1]])
    flt = TinyModel(qkv_f, gu_f, emb, lib.F32).run(STEPS)
    for q, f in zip(quant, flt, strict=True):
        assert (q - f).abs().max() <= 0.05 * float(f.max() - f.min())


def test_ctx_refuses_an_unreadable_embedding_type():
    qkv = lib.stack_mats(_qkv_parts())
    with pytest.raises(AssertionError):
        TinyModel(qkv, _gate_up(), random_blocks(lib.Q4_K, VOCAB, HIDDEN), 99)


@pytest.mark.parametrize("qtype", GEMM_TYPES)
def test_large_batches_unpack_once_and_compute_the_same_bits(qtype):
    # 64 rows make 16 calls per 16-row pair of tiles: on AVX-512 VNNI machines the K-quants'
    # weights are then unpacked once per pair into the thread's scratch (tile16.c,
    # SX_X2_UNPACK); rows 1 to 64 must come out as each row alone and the scalar build give them.
    rows, cols = 48, 768  # 3 super-blocks; 3 pairs of tiles, split over 2 threads
    mat = mat_of(qtype, random_blocks(qtype, rows, cols, seed=11), rows, cols, torch.randn(rows))
    x = torch.randn(64, cols)
    y = lib.gemm(mat, x, threads=2)
    assert torch.equal(y, lib.gemm(mat, x, threads=2, variant="portable"))
    assert torch.equal(y[5:6], lib.gemm(mat, x[5:6], threads=1))
    assert torch.equal(y, lib.gemm(mat, x, threads=1))
