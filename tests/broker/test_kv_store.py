"""The KV store's consumer side: `taken` hands out the lease's bytes (a view of the shared
memory, not a copy) and frees the lease after the block, whatever happens in it."""

from __future__ import annotations

import os

import pytest
import torch
from syshax.broker.kv_store import KVStore, KVStoreError


def _segment_exists(handle) -> bool:
    return os.path.exists(f"/dev/shm/{handle.location}")


def test_shm_is_read_in_place_and_freed_after(r):
    kv = KVStore(r, ttl=30)
    blob = bytes(range(256)) * 64
    h = kv.put(blob, {"num_tokens": 1}, "req-view", store="shm")
    with kv.taken(h) as view:
        assert isinstance(view, memoryview), "shared memory is read in place, not copied"
        assert bytes(view) == blob
        # What an import does with it: tensors on the view, copied into a cache.
        copied = torch.frombuffer(view, dtype=torch.uint8).clone()
        assert _segment_exists(h)
    assert bytes(copied.numpy()) == blob
    assert kv.stats() == (0, 0), "the lease is freed after the block"
    assert not _segment_exists(h), "and its segment unlinked"


def test_a_failed_import_still_frees_the_lease(r):
    kv = KVStore(r, ttl=30)
    h = kv.put(b"k" * 4096, {}, "req-fail", store="shm")
    with pytest.raises(ValueError), kv.taken(h) as view:
        kept = torch.frombuffer(view, dtype=torch.uint8)  # alive in the traceback
        raise ValueError(f"not this model ({kept.numel()} bytes)")
    assert kv.stats() == (0, 0) and not _segment_exists(h)


def test_redis_store_gives_the_bytes(r):
    kv = KVStore(r, ttl=30)
    h = kv.put(b"r" * 1000, {}, "req-redis", store="redis")
    with kv.taken(h) as blob:
        assert blob == b"r" * 1000
    assert kv.stats() == (0, 0)


def test_a_freed_lease_cannot_be_taken(r):
    kv = KVStore(r, ttl=30)
    h = kv.put(b"x" * 100, {}, "req-gone", store="shm")
    assert kv.free_request("req-gone") == 1
    with pytest.raises(KVStoreError, match="expired or was freed"), kv.taken(h):
        pass
