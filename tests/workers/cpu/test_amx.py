"""Intel AMX for the quantized GEMMs of prompt chunks (workers/cpu/native/amx.c): Q4_0, Q4_1,
Q8_0, Q4_K, Q5_K and Q6_K give the same bits as the VNNI tiles, in the GEMM and in the fused step,
whatever the row count.
AMX takes GEMMs of 48 activation rows or more (SX_AMX_MIN_ROWS); the other kernel tests stay
under that and test the VNNI tiles. On a machine without AMX-INT8 these tests skip."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from syshax.shared import env
from syshax.workers.cpu import lib

from .test_fused import PROMPT, _engine
from .test_kquants import mat_of, random_blocks


@pytest.fixture
def amx():
    native = lib.load()
    if not native.sx_amx_enable(1):
        native.sx_amx_enable(int(env.amx()))
        pytest.skip(
            "no AMX-INT8 here: it needs an Intel CPU of the Sapphire Rapids class or later, "
            "Linux >= 5.16 and the kernels built for it (-march=native)"
        )
    yield native
    native.sx_amx_enable(int(env.amx()))  # as lib.load left it


def _off_and_on(native, compute):
    native.sx_amx_enable(0)
    assert not native.sx_amx_active()
    off = compute()
    assert native.sx_amx_enable(1)
    return off, compute()


@pytest.mark.parametrize(("rows", "cols"), [(40, 192), (264, 576), (48, 2048)])
@pytest.mark.parametrize("n", [47, 48, 49, 65, 100])
def test_amx_gemm_is_the_vnni_gemm_bit_for_bit(amx, rows, cols, n):
    """Rows past the last whole 16 go to the 8-row tiles; 576 columns are 18 blocks, not a
    multiple of the 4 that share the C tiles; 47 activation rows stay on VNNI
    (SX_AMX_MIN_ROWS), 49 and 65 leave a last AMX group of 1 row (its tile reads the padding
    rows, which must not leak in)."""
    g = torch.Generator().manual_seed(rows + cols + n)
    w = torch.randn(rows, cols, generator=g)
    mat = lib.quant_mat(lib.Q4_0, lib.quantize(w, lib.Q4_0), rows, cols, torch.randn(rows))
    x = torch.randn(n, cols, generator=g) * 4
    off, on = _off_and_on(amx, lambda: lib.gemm(mat, x, threads=2))
    assert torch.isfinite(off).all()
    assert torch.equal(on, off)


@pytest.mark.parametrize("qtype", [lib.Q4_1, lib.Q8_0, lib.Q4_K, lib.Q5_K, lib.Q6_K])
@pytest.mark.parametrize(("rows", "cols"), [(40, 256), (264, 2048)])
@pytest.mark.parametrize("n", [47, 49, 100])
def test_amx_gemm_of_other_types_is_the_vnni_gemm_bit_for_bit(amx, qtype, rows, cols, n):
    """Q4_1 and Q8_0 (against the 8-row VNNI tile), Q4_K, Q5_K and Q6_K (against the 16-row
    one), random blocks (every scale, min and 5th / 6th bit pattern, Q6_K's int8 scales down to
    -128, so its products reach the int32 and float extremes): one K-quant super-block and eight,
    a remainder tile of 8 rows, a last AMX group of 1 activation row."""
    mat = mat_of(qtype, random_blocks(qtype, rows, cols, seed=n), rows, cols, torch.randn(rows))
    x = torch.randn(n, cols, generator=torch.Generator().manual_seed(n)) * 3
    off, on = _off_and_on(amx, lambda: lib.gemm(mat, x, threads=2))
    assert torch.isfinite(off).all()
    assert torch.equal(on, off)


@pytest.mark.parametrize("qtype", [lib.Q4_0, lib.Q4_1, lib.Q8_0])
@pytest.mark.parametrize(("rows", "n"), [(64, 49), (72, 64)])
def test_amx_in_column_chunks_is_the_vnni_gemm_bit_for_bit(amx, qtype, rows, n):
    """16,384 columns at 49-64 rows are 0.85-1.1 MB of activation blocks, past SX_AMX_ACT_L2
    (768 KB): sx_amx_span multiplies them in column chunks (of 472 and 40 blocks, of 360 and
    152), every 16-row group's partial sums kept between chunks; 72 rows leave 8 for the 8-row
    tile after the groups. The same bits as one pass on the VNNI tiles."""
    cols = 16384
    mat = mat_of(qtype, random_blocks(qtype, rows, cols, seed=rows), rows, cols, torch.randn(rows))
    x = torch.randn(n, cols, generator=torch.Generator().manual_seed(n)) * 3
    off, on = _off_and_on(amx, lambda: lib.gemm(mat, x, threads=2))
    assert torch.isfinite(off).all()
    assert torch.equal(on, off)


def test_amx_reshapes_the_tiles_between_q6_k_and_other_types(amx):
    """Q6_K's tiles have their own shapes (16-column A tiles, 4-row B tiles): a call after a
    call of another type on the same threads must load them, and the next other call its own
    again, as a fused step of a Q4_K_M file alternates the two."""
    rows, cols, n = 48, 512, 64
    mats = [
        mat_of(t, random_blocks(t, rows, cols, seed=t), rows, cols)
        for t in (lib.Q6_K, lib.Q4_K, lib.Q4_0)
    ]
    x = torch.randn(n, cols, generator=torch.Generator().manual_seed(1)) * 3

    def alternating():
        return [lib.gemm(m, x, threads=2) for m in (*mats, *mats)]

    off, on = _off_and_on(amx, alternating)
    for a, b in zip(off, on, strict=True):
        assert torch.isfinite(a).all()
        assert torch.equal(b, a)


def test_amx_is_reported_in_the_kernels_simd_string(amx):
    assert amx.sx_simd().decode().endswith("+amx")
    amx.sx_amx_enable(0)
    assert not amx.sx_simd().decode().endswith("+amx")


def test_fused_step_with_amx_gives_the_same_logits(amx, tiny_models):
    """A Q4_0 model's step with a prompt chunk of 60 rows and a decode row: every matrix with
    16 rows or more runs on AMX, and the logits are those of the VNNI tiles, bit for bit."""
    from syshax.workers.cpu.fused import FusedDecoder

    folder, _ = tiny_models["llama"]
    engine = _engine(folder, quantize="q4_0", op_mode="fused")
    prompt = (PROMPT * 7)[:60]
    blocks = -(-61 // engine.cache.block_size)
    tables = [list(range(blocks)), list(range(blocks, 2 * blocks))]
    args = (prompt + [1], list(range(60)) + [0], [0] * 60 + [1], tables, [59, 60])
    fused = FusedDecoder(engine.model, engine.cache, threads=2, max_tokens=64)
    try:
        off, on = _off_and_on(amx, lambda: fused.step(*args).clone())
    finally:
        fused.close()
    assert torch.isfinite(off).all()
    assert torch.equal(on, off)


def test_amx_survives_other_code_releasing_the_tiles(amx):
    """PyTorch's oneDNN runs bf16 matmuls on AMX on the same threads and ends them with
    TILERELEASE: a kernel that loaded its tile shapes once per thread then raised SIGILL on the
    next call (it killed a CI worker in `syshax eval perplexity`). In a child process, so that a
    crash is this test's failure and not the whole run's. oneDNN's product stays the same too."""
    script = textwrap.dedent(
        """
        import torch
        from syshax.workers.cpu import lib
        a = torch.randn(256, 256, dtype=torch.bfloat16)
        product = a @ a  # oneDNN's AMX bf16 kernel where the CPU has it, before ours ran
        assert lib.load().sx_amx_enable(1)
        mat = lib.quant_mat(lib.Q4_0, lib.quantize(torch.randn(64, 256), lib.Q4_0), 64, 256)
        x = torch.randn(64, 256)
        first = [lib.gemm(mat, x, threads=t) for t in (1, 2)]
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert torch.equal(a @ a, product)  # and after: our tile shapes do not leak into it
            assert all(torch.equal(lib.gemm(mat, x, threads=t), y) for t, y in zip((1, 2), first))
        print("ok")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("ok")
