"""The KV-handle store: where a request's KV cache waits between prefill and decode, as a lease.

Backends, by where the consumer is:
  * `shm`: a POSIX shared-memory segment on this host (one copy in, one copy out, no Redis
    traffic for the bytes);
  * `redis`: the bytes as a Redis value, readable from any host.
(The same-process case never creates a handle: the engine keeps the sequence.)

Every handle is a lease recorded in Redis (hash + an expiry index + an owner index): the
consumer frees it after import (`take`), the TTL sweeper frees orphans, and cancelling a
request frees its lease wherever the bytes are. Leaked KV is a bug; `stats()` counts leases.

Shared-memory segments are named `syshax-kv-<farm>-<handle>`, `<farm>` being `keys.farm_tag`
of the farm's Redis and prefix: `syshax run` sweeps its own farm's segments at start and at
stop (`sweep_segments`), so a farm killed with SIGKILL leaves nothing in /dev/shm past its next
start, and never touches another farm's.
"""

from __future__ import annotations

import _posixshmem  # the shm_unlink that SharedMemory.unlink calls
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Iterator
from multiprocessing import resource_tracker, shared_memory

import redis

from .connect import address
from .keys import KEYS, Keys, farm_tag
from .schemas import KVHandle

log = logging.getLogger(__name__)
HOST = socket.gethostname()
SHM_DIR = "/dev/shm"  # where POSIX shared memory appears on Linux


def segment_prefix(farm: str) -> str:
    return f"syshax-kv-{farm}-"


def sweep_segments(farm: str) -> int:
    """Unlink every shared-memory KV segment of this farm (at `syshax run`'s start and stop,
    when none of its workers runs); returns how many. Nothing to do where /dev/shm is absent."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return 0
    prefix = segment_prefix(farm)
    swept = 0
    for name in names:
        if name.startswith(prefix):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, name))
                swept += 1
    return swept


class KVStoreError(RuntimeError):
    """A handle whose bytes are gone (expired, freed, or on another host)."""


class KVStore:
    def __init__(
        self,
        r: redis.Redis,
        keys: Keys = KEYS,
        ttl: float = 120.0,
        worker_id: str = "",
        farm: str | None = None,
    ):
        self.r = r
        self.keys = keys
        self.ttl = ttl
        self.worker_id = worker_id
        # Names this store's segments; None = the tag of this client's own connection.
        self.farm = farm if farm is not None else farm_tag(address(r), keys.prefix)

    # ---- producer ----------------------------------------------------------------------

    def put(self, blob: bytes, meta: dict, request_id: str, store: str = "redis") -> KVHandle:
        """Store `blob` (a kv_format blob) and record its lease. `meta`: header fields."""
        handle_id = uuid.uuid4().hex
        expires = time.time() + self.ttl
        handle = KVHandle(
            handle_id=handle_id,
            store=store,
            host=HOST,
            model_id=meta.get("model_id", ""),
            dtype=meta.get("dtype", ""),
            num_layers=meta.get("num_layers", 0),
            num_kv_heads=meta.get("num_kv_heads", 0),
            head_dim=meta.get("head_dim", 0),
            num_tokens=meta.get("num_tokens", 0),
            nbytes=len(blob),
            owner=request_id,
            created_by=self.worker_id,
            expires_at=expires,
        )
        # Without MULTI: the lease, the index and the owner set are in three slots. A process
        # killed between them leaves keys that expire by themselves (every one has a TTL but
        # the index, whose entries without a lease the sweeper drops).
        pipe = self.r.pipeline(transaction=False)
        if store == "shm":
            handle.location = segment_prefix(self.farm) + handle_id[:24]
        elif store == "redis":
            handle.location = self.keys.kv_blob(handle_id)
            pipe.set(handle.location, blob, px=int(self.ttl * 1000) + 60_000)
        else:
            raise ValueError(f"unknown KV store {store!r} (shm, redis)")
        self._record(pipe, handle)
        # The lease is recorded before any shared memory exists (and `free` unlinks before
        # it forgets the lease): a process killed in between leaves a lease the sweeper
        # frees, never a segment nobody knows about.
        pipe.execute()
        if store == "shm":
            try:
                seg = shared_memory.SharedMemory(
                    name=handle.location, create=True, size=max(len(blob), 1)
                )
                # The lease, not this process, owns the segment: without this, Python's
                # resource tracker would unlink it when the producer exits, before a
                # consumer reads it.
                _untrack(seg)
                seg.buf[: len(blob)] = blob
                seg.close()
            except BaseException:
                self.free(handle_id)
                raise
            if not self.r.exists(self.keys.kv_lease(handle_id)):
                _unlink(handle.location)  # freed (a cancel) before the segment existed
        return handle

    def _record(self, pipe, h: KVHandle) -> None:
        lease = self.keys.kv_lease(h.handle_id)
        pipe.set(lease, h.pack(), px=int(self.ttl * 1000) + 60_000)
        pipe.zadd(self.keys.kv_leases, {h.handle_id: h.expires_at})
        pipe.sadd(self.keys.kv_owner(h.owner), h.handle_id)
        pipe.expire(self.keys.kv_owner(h.owner), int(self.ttl) + 60)

    # ---- consumer ----------------------------------------------------------------------

    def take(self, handle: KVHandle) -> bytes:
        """Read the bytes (a copy) and free the lease."""
        with self.taken(handle) as blob:
            return bytes(blob)

    @contextlib.contextmanager
    def taken(self, handle: KVHandle) -> Iterator[bytes | memoryview]:
        """The consumer's one call: the lease's bytes for the block, then the lease is freed.
        From shared memory they are a view of the segment, not a copy: an import copies them
        once, into its cache (a 1B model's 1k-token KV is 32 MB; a copy of it costs a
        CPU decode step's worth of time on a small host). Nothing may keep the view after
        the block."""
        try:
            if handle.store == "redis":
                blob = self.r.get(handle.location)
                if blob is None:
                    raise KVStoreError(f"KV handle {handle.handle_id} expired or was freed")
                yield blob
                return
            seg = self._open_segment(handle)
            view = seg.buf[: handle.nbytes]
            try:
                yield view
            finally:
                # An exception's traceback may still hold tensors on the view: the mapping
                # then goes with the last of them (unlinking below does not need it closed).
                with contextlib.suppress(BufferError):
                    view.release()
                    seg.close()
        finally:
            self._release(handle.handle_id, handle)  # the consumer holds it: no lookup

    def _open_segment(self, handle: KVHandle) -> shared_memory.SharedMemory:
        if handle.store != "shm":
            raise KVStoreError(f"KV handle {handle.handle_id}: unknown store {handle.store!r}")
        if handle.host != HOST:
            raise KVStoreError(f"KV handle {handle.handle_id} is in shared memory on {handle.host}")
        try:
            seg = shared_memory.SharedMemory(name=handle.location)
        except FileNotFoundError as exc:
            raise KVStoreError(f"KV handle {handle.handle_id} expired or was freed") from exc
        _untrack(seg)
        if seg.size < handle.nbytes:
            seg.close()
            raise KVStoreError(f"KV handle {handle.handle_id}: its segment is short")
        return seg

    # ---- freeing -------------------------------------------------------------------------

    def free(self, handle_id: str) -> bool:
        """Free one lease and its bytes; True if it existed. Safe to call twice."""
        raw = self.r.get(self.keys.kv_lease(handle_id))
        handle = KVHandle.unpack(raw) if raw is not None else None
        self._release(handle_id, handle)
        return handle is not None

    def _release(self, handle_id: str, handle: KVHandle | None) -> None:
        """The bytes, then every record of the lease (`handle`: None when it is gone already)."""
        local_segment = handle is not None and handle.store == "shm" and handle.host == HOST
        if local_segment:
            _unlink(handle.location)  # the bytes first: see put()
        pipe = self.r.pipeline(transaction=False)
        pipe.delete(self.keys.kv_lease(handle_id))
        pipe.zrem(self.keys.kv_leases, handle_id)
        pipe.delete(self.keys.kv_blob(handle_id))
        if handle is not None:
            pipe.srem(self.keys.kv_owner(handle.owner), handle_id)
        pipe.execute()
        if local_segment:
            # Again, now that the lease is gone: a producer may have created the segment after
            # the first unlink and checked the lease before the delete above (a cancel racing
            # `put`). Either its check saw the lease gone and it unlinks, or this one does.
            _unlink(handle.location)

    def free_request(self, request_id: str) -> int:
        """Free every lease a request owns (on cancel). Returns how many were freed."""
        ids = self.r.smembers(self.keys.kv_owner(request_id))
        freed = sum(self.free(i.decode() if isinstance(i, bytes) else i) for i in ids)
        self.r.delete(self.keys.kv_owner(request_id))
        return freed

    def sweep(self, now: float | None = None) -> int:
        """Free every lease past its expiry. Any worker may run it; it is idempotent."""
        now = time.time() if now is None else now
        expired = self.r.zrangebyscore(self.keys.kv_leases, "-inf", now)
        freed = 0
        for hid in expired:
            hid = hid.decode() if isinstance(hid, bytes) else hid
            if self.free(hid):
                log.warning("freed orphaned KV lease %s (expired)", hid)
                freed += 1
            else:
                self.r.zrem(self.keys.kv_leases, hid)
        return freed

    def stats(self) -> tuple[int, int]:
        """(leases held, bytes held) across the farm."""
        ids = self.r.zrange(self.keys.kv_leases, 0, -1)
        total = 0
        for hid in ids:
            raw = self.r.get(self.keys.kv_lease(hid.decode() if isinstance(hid, bytes) else hid))
            if raw is not None:
                total += KVHandle.unpack(raw).nbytes
        return len(ids), total


def _untrack(seg: shared_memory.SharedMemory) -> None:
    # Tracker internals differ between Python versions: failing to unregister is harmless.
    with contextlib.suppress(Exception):
        resource_tracker.unregister(seg._name, "shared_memory")  # type: ignore[attr-defined]


def _unlink(name: str) -> None:
    # By name, without opening it: a segment just created and not yet sized cannot be mapped
    # (opening it would raise), and the segments are untracked, so no tracker needs telling.
    with contextlib.suppress(FileNotFoundError):
        _posixshmem.shm_unlink("/" + name)
