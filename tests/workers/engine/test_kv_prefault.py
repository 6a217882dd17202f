"""kv_prefault: the pages of the next free KV blocks made resident without changing them."""

from __future__ import annotations

import math
import mmap
import resource
from types import SimpleNamespace

import torch
from syshax.workers.engine import kv_prefault
from syshax.workers.engine.block_manager import BlockManager


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _fresh(shape: tuple[int, ...]) -> torch.Tensor:
    """A float16 tensor on pages never touched: its own anonymous mapping. torch.empty may
    reuse heap memory an earlier test already faulted in (in a full run it did: the
    never-populated blocks then took 0 faults), and this test counts faults."""
    buf = mmap.mmap(-1, math.prod(shape) * 2)
    return torch.frombuffer(buf, dtype=torch.float16).view(shape)


class _Cache(SimpleNamespace):
    """kv_cache.KVCache's k and v; hashed by identity like KVCache (kv_prefault keeps a weak
    map from each cache to its resident blocks)."""

    __hash__ = object.__hash__


def _cache(blocks: int = 64) -> _Cache:
    shape = (4, blocks, 8, 16, 64)  # [layers, blocks, kv heads, block size, head dim]: 16 KiB
    return _Cache(k=_fresh(shape), v=_fresh(shape))


def test_populated_blocks_are_written_without_faults_and_keep_their_contents():
    cache = _cache()
    cache.k[1, 3].fill_(1.5)  # a block in use: its contents must survive
    assert kv_prefault.populate(cache, [3, 4, 5, 6, 40]) == 2 * 4 * 2  # K/V x layers x runs
    before = _faults()
    cache.k[:, 4:7].fill_(2.0)
    cache.v[:, 4:7].fill_(2.0)
    populated = _faults() - before
    before = _faults()
    cache.k[:, 10:13].fill_(2.0)  # never populated: faulted in by the write
    cache.v[:, 10:13].fill_(2.0)
    fresh = _faults() - before
    assert fresh >= 2 * 4 * 3 * 4  # 4 pages a block per layer and tensor (some may be huge)
    assert populated < fresh / 4, (populated, fresh)
    assert torch.all(cache.k[1, 3] == 1.5)


def test_ahead_populates_the_head_of_the_free_list_and_ignores_other_engines():
    cache, blocks = _cache(), BlockManager(64, 16)
    engine = SimpleNamespace(runner=SimpleNamespace(cache=cache), scheduler=SimpleNamespace(blocks=blocks))  # fmt: skip
    assert kv_prefault.ahead(engine, count=8) == 2 * 4  # blocks 0-7: one run per layer and tensor
    assert kv_prefault.ahead(engine, count=8) == 0  # already resident: not again
    assert kv_prefault.ahead(engine, count=12) == 2 * 4  # only blocks 8-11 are new
    assert kv_prefault.ahead(SimpleNamespace(), count=8) == 0  # echo, emulated, vLLM engines
