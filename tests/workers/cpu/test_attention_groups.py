"""The fused step's attention kernel (sx_attend_heads_paged) scores and accumulates up to four
query heads of a KV group per load of a key or value. Grouping must not change a head's numbers:
every head of a group gets the bits it gets when attended alone, on every build (native and the
portable scalar one), for any group size, head size, context length and cache type (float32,
float16, Q8_0 blocks); and the result is attention: softmax(q K^T / sqrt(d)) V over the cached
positions plus the new one, with the cache's keys and values as its type holds them."""

from __future__ import annotations

import math

import pytest
import torch
from syshax.workers.cpu import lib

BS = 16  # positions per KV block


class _Case:
    """A paged cache of `kv_heads` KV heads with blocks in a shuffled order, one KV head's
    group of query heads, and the new position's key and value."""

    def __init__(self, heads: int, d: int, cached: int, kind: str, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.heads, self.d, self.cached, self.kind = heads, d, cached, kind
        self.kv_heads, self.group = 3, 1  # attend KV head 1: its rows sit between two others
        blocks = cached // BS + 3
        shape = (blocks, self.kv_heads, BS, d)
        self.k, self.v = (self._stored(torch.randn(shape, generator=g)) for _ in range(2))
        self.table = torch.randperm(blocks, generator=g).to(torch.int32)
        self.q = torch.randn(heads, d, generator=g)
        self.k_new = torch.randn(d, generator=g)
        self.v_new = torch.randn(d, generator=g)

    def _stored(self, x: torch.Tensor) -> torch.Tensor:
        """x as a cache of this case's kind holds it (Q8_0: uint8 rows of blocks)."""
        if self.kind != "q8_0":
            return x.to(getattr(torch, self.kind))
        rows = lib.quantize(x.reshape(-1, self.d), lib.Q8_0)
        return rows.reshape(*x.shape[:-1], rows.shape[-1])

    def _floats(self, cache: torch.Tensor) -> torch.Tensor:
        """The cache's values as float64 [blocks, kv_heads, BS, d]."""
        if self.kind != "q8_0":
            return cache.double()
        x = lib.dequantize(cache.reshape(-1, cache.shape[-1]), lib.Q8_0, self.d)
        return x.reshape(*cache.shape[:-1], self.d).double()

    def run(self, variant: str, heads: range | None = None) -> torch.Tensor:
        """Attention of query heads `heads` (default all, in one call) as the kernel gives it."""
        heads = heads or range(self.heads)
        n = len(heads)
        q = self.q[heads.start : heads.stop].contiguous()
        scores = torch.zeros(n, self.cached + 1)
        out = torch.full((n, self.d), float("nan"))  # the kernel must write every element
        lib.attend_heads(
            q, self.k, self.v, self.table, self.group, self.cached, self.k_new, self.v_new,
            scores, out, variant,
        )  # fmt: skip
        return out

    def reference(self) -> torch.Tensor:
        """softmax(q K^T / sqrt(d)) V in float64, positions in sequence order."""
        order = self.table.long()
        keys = self._floats(self.k)[order, self.group].reshape(-1, self.d)[: self.cached]
        values = self._floats(self.v)[order, self.group].reshape(-1, self.d)[: self.cached]
        keys = torch.cat([keys, self.k_new.double()[None]])
        values = torch.cat([values, self.v_new.double()[None]])
        p = torch.softmax(self.q.double() @ keys.T / math.sqrt(self.d), dim=-1)
        return (p @ values).float()


CASES = [
    (heads, d, cached, kind)
    for heads, d, cached in [
        (1, 64, 0),
        (4, 64, 1),
        (4, 64, 37),
        (3, 64, 130),
        (7, 128, 50),
        (5, 72, 33),
        (2, 64, 16),
        (8, 64, 200),
    ]
    for kind in ("float16", "float32", "q8_0")
    if kind != "q8_0" or d % 32 == 0  # Q8_0 rows are whole blocks of 32
]


@pytest.mark.parametrize(("heads", "d", "cached", "kind"), CASES)
def test_a_group_attended_together_gives_each_head_its_own_bits(heads, d, cached, kind):
    case = _Case(heads, d, cached, kind, seed=heads * 1000 + d + cached)
    together = case.run("native")
    alone = torch.cat([case.run("native", range(h, h + 1)) for h in range(heads)])
    assert torch.equal(together, alone)
    assert torch.equal(together, case.run("portable"))  # the scalar build: the same bits
    torch.testing.assert_close(together, case.reference(), rtol=1e-4, atol=1e-5)
