"""Fault in the KV cache blocks the next sequences will take, before a step no stream waits on.

The fused CPU step's cache is allocated, not filled (kv_cache.KVCache zero=False): each block's
pages are faulted in when a sequence first writes it, inside the step, by one kernel thread
while the other waits at the next barrier. A sequence takes a fresh block every 16 positions,
so at one stream the first decode step (position 128 of a 128-token prompt) and every 16th
after it took 96-128 minor faults: ~0.5 ms at 4.7 us a fault on the quiet VM, and 10-35 ms
when other processes pressed on memory (a loop trace at 1 stream, workers/loop_trace.py: the
steps at those positions 20-40% slower than the rest). `ahead` populates the first blocks of
the free list with MADV_POPULATE_WRITE (contents unchanged, so a block in use or cached is safe
too) where no token waits on the time it takes: the worker calls it before a prompt-only step.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import weakref
from typing import Any

log = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # Linux 5.14+
PAGE = 4096
AHEAD_BLOCKS = 32  # two 1B-shape streams of 256 positions; 16 MiB of K and V at the 1B shape

_libc: Any = None
_supported = True
# The blocks of each cache already made resident: anonymous memory stays resident (no swap
# here), so a block is populated once, not before every prompt-only step.
_resident: weakref.WeakKeyDictionary[Any, set[int]] = weakref.WeakKeyDictionary()


def _madvise() -> Any:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc.madvise.restype = ctypes.c_int
    return _libc.madvise


def populate(cache: Any, blocks: list[int]) -> int:
    """Make the pages of `blocks` of `cache` (kv_cache.KVCache, [layers, blocks, ...] K and V)
    resident; returns the madvise calls made (0 when the kernel cannot, or not a CPU cache)."""
    global _supported
    if not blocks or not _supported or cache.k.device.type != "cpu":
        return 0
    runs: list[tuple[int, int]] = []  # (first block, count) of consecutive block ids
    for b in sorted(set(blocks)):
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    madvise, calls = _madvise(), 0
    for t in (cache.k, cache.v):
        per_block = t[0, 0].numel() * t.element_size()
        for layer in range(t.shape[0]):
            base = t[layer].data_ptr()
            for first, count in runs:
                start = base + first * per_block
                end = start + count * per_block
                lo, hi = start // PAGE * PAGE, -(-end // PAGE) * PAGE
                if madvise(lo, hi - lo, MADV_POPULATE_WRITE) != 0:
                    _supported = False  # an older kernel: faults stay in the steps
                    log.info("MADV_POPULATE_WRITE refused (errno %d)", ctypes.get_errno())
                    return calls
                calls += 1
    return calls


def ahead(engine: Any, count: int = AHEAD_BLOCKS) -> int:
    """Populate the first `count` blocks of the native engine's free list (the next ones its
    sequences take); other engines (echo, emulated, vLLM, a GPU cache): nothing."""
    cache = getattr(getattr(engine, "runner", None), "cache", None)
    blocks = getattr(getattr(engine, "scheduler", None), "blocks", None)
    if cache is None or blocks is None:
        return 0
    done = _resident.setdefault(cache, set())
    todo = [b for b in itertools.islice(blocks.free, count) if b not in done]
    calls = populate(cache, todo)
    if calls:
        done.update(todo)
    return calls
