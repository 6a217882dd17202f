"""The worker's side of the broker (sync redis-py): take jobs, publish tokens, heartbeat, cancels.

Jobs are read with one consumer group on every work stream (at-least-once). An entry is
acked and deleted when its request is done with this worker, so a stream's length is the
number of jobs waiting plus in flight. A worker that dies leaves its entries pending; live
workers claim the entries of consumers whose heartbeat is gone (`claim_orphans`), and a worker
that comes back under the same id (a restart, a reconnect to Redis) takes its own entries back
(`own_pending`).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass, field

import redis

from . import itl_tails, waiting_jobs
from .keys import DEVICE_CLASSES, KEYS, Keys
from .liveness import HEARTBEAT_TTL, is_alive
from .schemas import RequestPart
from .text import as_text

log = logging.getLogger(__name__)
# A claim skips entries delivered (or claimed) less than this long ago: two live workers that
# see the same orphan at once do not both take it (XCLAIM resets the idle time).
CLAIM_MIN_IDLE_MS = 1000


@dataclass
class Entry:
    stream: str
    entry_id: str
    data: bytes | None  # None: the entry was deleted before we read it
    reclaimed: bool = False


@dataclass
class Claim:
    """A claim round's take: the entries now ours, and `left`, the dead consumers' entries seen
    but not taken (no room here, or another worker's claim came first). A worker holds its
    reads of new work back while some are left: they were a client's stream in the middle."""

    entries: list[Entry] = field(default_factory=list)
    left: int = 0


def _job_data(fields: dict | None) -> bytes | None:
    """The job bytes of a stream entry: None for a deleted entry (no fields), b"" for an entry
    without a `j` field (garbage: it is dead-lettered, not silently dropped)."""
    if not fields:
        return None
    data = fields.get(b"j")
    return data if isinstance(data, bytes) else b""


class WorkQueues:
    """The streams one worker consumes, under one consumer group."""

    def __init__(self, r: redis.Redis, streams: list[str], consumer: str, keys: Keys = KEYS):
        self.r, self.streams, self.consumer, self.keys = r, streams, consumer, keys
        self.group = keys.prefill_group

    def ensure_groups(self) -> None:
        for stream in self.streams:
            try:
                self.r.xgroup_create(stream, self.group, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    def read(self, count: int, block_ms: int | None) -> list[Entry]:
        if count <= 0:
            return []
        try:
            reply = self.r.xreadgroup(**self._read_args(count, block_ms))
        except redis.ResponseError as exc:
            return self.read_reply(exc)
        return self.read_reply(reply)

    def add_read(self, pipe: redis.client.Pipeline, count: int) -> None:
        """A non-blocking `read` on a pipeline (the worker's token write carries its poll:
        token_publisher.TokenPublisher.publish); its reply goes to `read_reply`."""
        pipe.xreadgroup(**self._read_args(count, None))

    def read_reply(self, reply) -> list[Entry]:
        """The entries of an XREADGROUP's reply (or of the error it gave)."""
        if isinstance(reply, redis.ResponseError):
            if "NOGROUP" not in str(reply):
                raise reply
            # Redis restarted empty under us (the client reconnected by itself): recreate.
            log.warning("consumer group gone (%s); recreating it", reply)
            self.ensure_groups()
            return []
        if isinstance(reply, Exception):
            raise reply
        out = []
        for stream, entries in reply or []:
            for entry_id, fields in entries:
                out.append(Entry(as_text(stream), as_text(entry_id), _job_data(fields)))
        return out

    def _read_args(self, count: int, block_ms: int | None) -> dict:
        return {
            "groupname": self.group,
            "consumername": self.consumer,
            "streams": {s: ">" for s in self.streams},
            "count": count,
            "block": block_ms,
        }

    def own_pending(self, count: int = 1000) -> list[Entry]:
        """Entries still pending under this consumer name: left by an earlier process with the
        same worker id (killed and restarted, or cut off from Redis). Nobody else claims them
        while this id heartbeats, so the worker takes them back itself, as reclaimed jobs."""
        out: list[Entry] = []
        for stream in self.streams:
            try:
                reply = self.r.xreadgroup(self.group, self.consumer, {stream: "0"}, count=count)
            except redis.ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                self.ensure_groups()  # a Redis that lost its data: nothing of ours is left
                continue
            for _, entries in reply or []:
                out += self._reclaimed(stream, entries)
        return out

    def lost_own(
        self, known: set[tuple[str, str]], min_idle_ms: int = CLAIM_MIN_IDLE_MS
    ) -> list[Entry]:
        """Entries pending under this consumer name that this process never received (not in
        `known`, the (stream, entry id) of each entry it holds: two streams give their entries
        the same id when they are added in the same millisecond), idle at least `min_idle_ms`,
        claimed back.

        Redis delivers a stream entry to a consumer's blocked XREADGROUP and records it as
        pending before it writes the reply. When that connection is already dead (a killed
        process whose socket was not yet closed; a connection cut by the network, which the
        server keeps until TCP gives up on it), the entry is pending under our name, and
        nobody else claims it while our id heartbeats. `own_pending` at start cannot see an
        entry delivered after it ran, so the worker looks again on its claim timer."""
        out: list[Entry] = []
        rows = waiting_jobs.pending_of(self.r, self.streams, self.group, self.consumer)
        for stream, pending in zip(self.streams, rows, strict=True):
            if pending is None:  # no stream or group yet
                continue
            lost = [
                as_text(p["message_id"])
                for p in pending
                if (stream, as_text(p["message_id"])) not in known
                and p["time_since_delivered"] >= min_idle_ms
            ]
            if not lost:
                continue
            # XCLAIM to ourselves resets the idle time and hands back the fields.
            claims = self.r.xclaim(stream, self.group, self.consumer, min_idle_ms, lost)
            out += self._reclaimed(stream, claims)
        return out

    def _reclaimed(self, stream: str, entries: list) -> list[Entry]:
        """Entries taken back (from XREADGROUP 0 or XCLAIM) as reclaimed jobs; one deleted
        meanwhile has nothing to run and is acked."""
        out = []
        for entry_id, fields in entries:
            entry = Entry(stream, as_text(entry_id), _job_data(fields), reclaimed=True)
            if entry.data is None:
                self.ack(entry)
            else:
                out.append(entry)
        return out

    def ack(self, entry: Entry) -> None:
        pipe = self.r.pipeline()  # one key: one slot
        self.add_ack(pipe, entry)
        pipe.execute()

    def add_ack(self, pipe: redis.client.Pipeline, entry: Entry) -> None:
        """The ack of `entry` on a pipeline (with a MULTI or, riding a token write, without:
        token_publisher.TokenPublisher.ride). XDEL before XACK: a write cut between the two
        leaves a pending id of a deleted entry, which whoever claims it just acks
        (`_reclaimed`), never an acked entry left in the stream, counted by XLEN for good."""
        pipe.xdel(entry.stream, entry.entry_id)
        pipe.xack(entry.stream, self.group, entry.entry_id)

    def hand_over(self, entry: Entry, stream: str, data: bytes) -> None:
        """Queue a job made from `entry` on `stream` and ack `entry`, in one MULTI: the new job
        exists if and only if the old entry is acked, so a worker that dies here never leaves
        both (two workers on one request) or neither (a lost request). Every job stream has
        the farm's hash tag (keys.py), so on a cluster too this is one MULTI on one node."""
        pipe = self.r.pipeline(transaction=True)
        pipe.xadd(stream, {"j": data})
        pipe.xack(entry.stream, self.group, entry.entry_id)
        pipe.xdel(entry.stream, entry.entry_id)
        pipe.execute()

    def hand_over_choice(
        self,
        stream: str,
        data: bytes,
        *,
        request_id: str,
        choice: int,
        ttl: int,
        part: RequestPart | None,
        last: Entry | None,
    ) -> None:
        """Queue choice `choice`'s decode job (`data`) on `stream`, mark it handed off, store
        `part` (when given: the first handoff of this process), and ack `last` (the prefill
        entry, when no other choice of it is held here), in one MULTI: the decode job exists if
        and only if its mark does (choices.py: the marks and parts of a request of several
        choices). The keys share the farm's hash tag (keys.py): one slot on a cluster."""
        pipe = self.r.pipeline(transaction=True)
        pipe.xadd(stream, {"j": data})
        pipe.sadd(self.keys.handed_off(request_id), choice)
        pipe.expire(self.keys.handed_off(request_id), ttl)
        if part is not None:
            pipe.set(self.keys.request_part(request_id), part.pack(), ex=ttl)
        if last is not None:
            pipe.xack(last.stream, self.group, last.entry_id)
            pipe.xdel(last.stream, last.entry_id)
        pipe.execute()

    def requeue(self, entry: Entry) -> None:
        """Put `entry` back, unchanged, at the end of its own stream (a draining worker's
        unfinished job): the same one MULTI as a handoff."""
        self.hand_over(entry, entry.stream, entry.data or b"")

    def dead_letter(self, entry: Entry, reason: str) -> None:
        """Move a poison message aside (kept for inspection) so it cannot block the queue."""
        log.error("dead-lettering %s %s: %s", entry.stream, entry.entry_id, reason)
        self.r.xadd(
            self.keys.dead_letter_stream,
            {
                "stream": entry.stream,
                "id": entry.entry_id,
                "reason": reason[:500],
                "j": entry.data or b"",
            },
            maxlen=10_000,
            approximate=True,
        )
        self.ack(entry)

    def unread(self) -> int:
        """Entries of its streams no consumer has read yet."""
        return waiting_jobs.unread(self.r, self.streams, self.group)

    def claim_orphans(self, live_consumers: set[str], count: int) -> Claim:
        """Take over up to `count` pending entries whose consumer is no longer alive, oldest
        first (`Claim.left`: those seen and not taken)."""
        claim = Claim()
        summaries = waiting_jobs.pending_summaries(self.r, self.streams, self.group)
        for stream, summary in zip(self.streams, summaries, strict=True):
            dead = waiting_jobs.dead_pending(
                self.r, stream, self.group, summary, self.consumer, live_consumers
            )
            room = count - len(claim.entries)
            claim.left += len(dead)
            if not dead or room <= 0:
                continue
            claims = self.r.xclaim(
                stream, self.group, self.consumer, CLAIM_MIN_IDLE_MS, dead[:room]
            )
            claim.left -= len(claims)
            for entry_id, fields in claims:
                data = _job_data(fields)
                entry = Entry(stream, as_text(entry_id), data, reclaimed=True)
                if data is None:  # deleted entry: nothing to run
                    self.ack(entry)
                else:
                    claim.entries.append(entry)
        return claim


class Heartbeat:
    """The worker's hash, rewritten every beat with a TTL: when it expires the worker is dead.

    The TTL is written into the hash too (`ttl`), so readers judge each worker by its own."""

    def __init__(
        self, r: redis.Redis, worker_id: str, keys: Keys = KEYS, ttl: float = HEARTBEAT_TTL
    ):
        self.r, self.worker_id, self.keys = r, worker_id, keys
        self.ttl = ttl
        self.static = {
            "id": worker_id,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": time.time(),
            "ttl": ttl,
        }

    def beat(self, **fields) -> None:
        key = self.keys.worker(self.worker_id)
        mapping = {**self.static, **fields, "last_seen": time.time()}
        pipe = self.r.pipeline(transaction=False)  # the hash and the set: two slots
        pipe.hset(key, mapping={k: str(v) for k, v in mapping.items()})
        pipe.pexpire(key, max(int(self.ttl * 1000), 1))
        pipe.sadd(self.keys.workers, self.worker_id)
        pipe.execute()

    def remove(self) -> None:
        pipe = self.r.pipeline(transaction=False)
        pipe.delete(self.keys.worker(self.worker_id))
        pipe.srem(self.keys.workers, self.worker_id)
        pipe.execute()


def record_dispatch(
    pipe: redis.client.Pipeline, device: str, reason: str, keys: Keys = KEYS, rule: str = ""
) -> None:
    """Log a dispatcher decision (the last 100, for `syshax top`: `<unix time> <device>
    [<rule>] <reason>`) and count it per device, on a pipeline without MULTI (the worker's
    next token write carries it: token_publisher.TokenPublisher.ride). A model of a farm of
    several names itself first in the reason (`smol: ...`)."""
    reason = f"{keys.model}: {reason}" if keys.model else reason
    what = f"[{rule}] {reason}" if rule else reason
    pipe.lpush(keys.dispatch_log, f"{time.time():.3f} {device} {what}")
    pipe.ltrim(keys.dispatch_log, 0, 99)
    pipe.incr(keys.dispatch_count(device))


def live_workers(r: redis.Redis, keys: Keys = KEYS) -> list[dict[str, str]]:
    """Heartbeats of the workers alive now (`liveness.is_alive`); prunes ids whose hash expired.
    Keys of one model of a farm of several (`keys.model`): only the workers serving it, so a
    worker's claims, dispatch and capacity are its own model's."""
    ids = [as_text(i) for i in r.smembers(keys.workers)]
    if not ids:
        return []
    pipe = r.pipeline(transaction=False)  # one hash per worker: many slots
    for wid in ids:
        pipe.hgetall(keys.worker(wid))
    alive, dead = [], []
    now = time.time()
    for wid, h in zip(ids, pipe.execute(), strict=True):
        info = {as_text(k): as_text(v) for k, v in h.items()}
        if is_alive(info, now):
            alive.append(info)
        elif not info:
            dead.append(wid)
    if dead:
        r.srem(keys.workers, *dead)
    if keys.model:
        return [w for w in alive if w.get("model") == keys.model]
    return alive


def decoder_classes(workers: list[dict[str, str]]) -> set[str]:
    """The device classes with at least one of these (live) workers decoding."""
    return {w.get("device_class", "") for w in workers if "decode" in w.get("roles", "").split(",")}


def device_loads(r: redis.Redis, workers: list[dict[str, str]], keys: Keys = KEYS) -> dict:
    """DeviceLoad per device class, from live heartbeats and the decode streams (dispatcher input)."""
    from .dispatcher import DeviceLoad

    loads = {cls: DeviceLoad() for cls in DEVICE_CLASSES}
    for w in workers:
        if "decode" not in w.get("roles", "").split(","):
            continue
        load = loads.get(w.get("device_class", ""))
        if load is None:
            continue
        load.workers += 1
        load.capacity += int(w.get("capacity", 0))
        load.running += int(w.get("running", 0)) + int(w.get("waiting", 0))
        load.decode_tps += float(w.get("decode_tps", 0.0))
        if "step_base_ms" in w:
            model = (float(w["step_base_ms"]) / 1e3, float(w.get("step_row_ms", 0.0)) / 1e3)
            # The slowest worker's curve and tail: a new stream may land on any of them.
            load.step_model = max(load.step_model or model, model, key=lambda m: m[0] + m[1])
            load.step_tail = max(load.step_tail, float(w.get("step_tail", 1.0)))
    pipe = r.pipeline(transaction=False)
    for cls in loads:
        stream = keys.decode_stream(cls)
        pipe.xlen(stream)
        pipe.xpending(stream, keys.decode_group)
    pipe.xlen(keys.prefill_stream)
    pipe.xpending(keys.prefill_stream, keys.prefill_group)
    pipe.hgetall(keys.itl_tails)
    replies = pipe.execute(raise_on_error=False)
    delivered = replies[-1] if isinstance(replies[-1], dict) else {}
    for cls, ratio in itl_tails.fresh(delivered, time.time()).items():
        if cls in loads:
            loads[cls].delivered_tail = ratio

    def waiting(i: int) -> tuple[int, int]:
        length, pending = replies[2 * i], replies[2 * i + 1]
        taken = pending.get("pending", 0) if isinstance(pending, dict) else 0
        return max(int(length if isinstance(length, int) else 0) - taken, 0), taken

    for i, cls in enumerate(loads):
        loads[cls].queued, taken = waiting(i)
        # Heartbeats lag by up to a second; the stream's pending entries (jobs taken and not
        # yet finished) are exact for everything that was handed off.
        loads[cls].running = max(loads[cls].running, taken)
    # Prompts waiting for a prefill will each take a slot of the class that prefills them:
    # a class whose every slot is held while prompts wait has no room for one more stream.
    prefill_classes = {w.get("device_class") for w in workers if "prefill" in w.get("roles", "").split(",")}  # fmt: skip
    for cls in DEVICE_CLASSES:
        if cls in prefill_classes:
            loads[cls].queued += waiting(len(loads))[0]
            break
    return loads
