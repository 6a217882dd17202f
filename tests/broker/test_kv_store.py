"""The KV store's consumer side: `taken` hands out the lease's bytes (a view of the shared
memory, not a copy) and frees the lease after the block, whatever happens in it."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from syshax.broker import kv_store
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


def test_a_cancel_racing_the_producer_leaves_no_segment(r, monkeypatch):
    """A cancel that reads the lease and unlinks (nothing yet) before the producer creates the
    segment, and forgets the lease only after the producer's own check saw it, must still leave
    no segment: the interleaving that leaked segments under load."""
    kv = KVStore(r, ttl=30)
    canceller = KVStore(r, ttl=30)
    unlinked, put_done = threading.Event(), threading.Event()
    real_unlink, real_shm = kv_store._unlink, kv_store.shared_memory.SharedMemory
    first = [True]

    def slow_unlink(name):  # the canceller's first unlink waits for the producer to finish
        real_unlink(name)
        if threading.current_thread() is not threading.main_thread() and first[0]:
            first[0] = False
            unlinked.set()
            assert put_done.wait(10)

    def shm(*a, create=False, **kw):  # the cancel runs between the lease and the segment
        if create:
            t.start()
            assert unlinked.wait(10)
        return real_shm(*a, create=create, **kw)

    monkeypatch.setattr(kv_store, "_unlink", slow_unlink)
    monkeypatch.setattr(kv_store.shared_memory, "SharedMemory", shm)
    t = threading.Thread(target=canceller.free_request, args=("req-race",))
    h = kv.put(b"z" * 4096, {}, "req-race", store="shm")
    put_done.set()
    t.join(10)
    assert kv.stats() == (0, 0)
    assert not _segment_exists(h), "the cancel's segment outlived its lease"
