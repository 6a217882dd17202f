"""The gateway's side of the broker (redis.asyncio): submit jobs, receive tokens, cancel.

Each `BrokerClient` is one gateway with an id of its own: its jobs carry the id, and the
workers write each engine step's events of all its requests as one entry of its own stream
(broker/token_log.py). One reader task follows that stream with a blocking XREAD and routes
each event to its request's `TokenSubscription` (broker/subscription.py), which puts them in
order; a request's record (its output stream) and, for the newest events, the stream of the
gateway that submitted it serve a resume or a follower (`read_output`, `read_gateway`,
`follow_gateway` here).

The Redis client must be created with `decode_responses=False` (messages are msgpack bytes).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from . import itl_tails, token_log
from .amqp_jobs import job_streams
from .connect import clustered
from .job_transport import AsyncJobs
from .keys import KEYS, Keys
from .liveness import is_alive
from .queue_depth import AdmissionDepth
from .request_info import RequestInfo
from .schemas import KVHandle, PrefillJob, SchemaError, TokenEvent, entry_events
from .subscription import TokenSubscription
from .text import as_text

log = logging.getLogger(__name__)

READ_BLOCK_MS = 1000  # the reader's XREAD waits this long for an entry, then asks again
READ_COUNT = 256  # most entries (worker steps) one XREAD returns


class BrokerClient:
    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys = KEYS,
        output_ttl: int = 600,
        poll_interval: float = 0.5,
        jobs: AsyncJobs | None = None,
    ) -> None:
        self.redis = redis
        self.jobs = jobs  # RabbitMQ's job queues (broker.jobs amqp); None: the Redis streams
        self.keys = keys
        self.requests = RequestInfo(redis, keys)  # the resume record of each request
        self.output_ttl = output_ttl
        self.poll_interval = poll_interval
        self.gateway_id = uuid.uuid4().hex[:16]
        self.stream = keys.gateway_stream(self.gateway_id)
        self._cursor = "0-0"  # our stream's entry id read up to (a new id: it starts empty)
        self._reader: asyncio.Task[None] | None = None
        self._routes: dict[str, set[TokenSubscription]] = {}  # request id -> live subscriptions
        self._closed = False
        self._memory: tuple[float, float | None] = (0.0, None)  # (read at, memory_use)
        # The prefill queue's depth for admission, read at most every 50 ms (queue_depth.py)
        self.admission = AdmissionDepth(self.prefill_queue_depth)

    # ---- jobs and cancellation -------------------------------------------------------------
    async def submit(self, job: PrefillJob) -> None:
        """Queue a prefill job addressed to this gateway's stream (subscribe first: the reader
        routes an event only to the subscriptions that exist when it reads it)."""
        job.gateway = self.gateway_id
        try:
            if self.jobs is not None:
                await self.jobs.submit(self.keys.prefill_stream, job.pack())
            else:
                await self.redis.xadd(self.keys.prefill_stream, {"j": job.pack()})
        finally:  # a failed submit may still have queued it: counted, admission errs to refuse
            self.admission.note_submitted()

    async def save_and_submit(self, job: PrefillJob, info: dict[str, Any], ttl: int) -> None:
        """Record a new request (`requests.save`) and queue its prefill job (`submit`): on the
        Redis streams one pipeline, one round trip (issue 31), the record's commands sent
        before the XADD so it exists when a worker reads the job. (On a cluster the two keys'
        nodes run theirs in parallel; only a resume reads the record, and a client learns the
        request's id only after this returns.) RabbitMQ's job queues: the record, then the job.
        """
        if self.jobs is not None:
            await self.requests.save(job.request_id, info, ttl)
            await self.submit(job)
            return
        job.gateway = self.gateway_id
        try:
            async with self.redis.pipeline(transaction=False) as pipe:  # two slots
                self.requests.save_into(pipe, job.request_id, info, ttl)
                pipe.xadd(self.keys.prefill_stream, {"j": job.pack()})
                await pipe.execute()
        finally:
            self.admission.note_submitted()

    async def _waiting(self, stream: str, group: str) -> int:
        return (await self.stream_stats(stream, group))[0]

    async def stream_stats(self, stream: str, group: str) -> tuple[int, int]:
        """(waiting, in flight) of a work stream: entries not yet delivered to a worker, and
        entries delivered but not acked (workers XDEL after XACK, so XLEN = the sum). A job
        queue on RabbitMQ: (its ready jobs, 0): the jobs taken are not counted there."""
        if self.jobs is not None and stream in job_streams(self.keys):
            return await self.jobs.depth(stream), 0
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xlen(stream)
            pipe.xpending(stream, group)
            length, pending = await pipe.execute(raise_on_error=False)
        if isinstance(length, Exception):
            raise length
        if isinstance(pending, ResponseError):  # NOGROUP: no worker ever read the stream
            return int(length), 0
        if isinstance(pending, Exception):
            raise pending
        taken = int(pending.get("pending", 0))
        return max(0, int(length) - taken), taken

    async def kv_stats(self) -> tuple[int, int]:
        """(KV leases held, their bytes) across the farm."""
        ids = await self.redis.zrange(self.keys.kv_leases, 0, -1)
        if not ids:
            return 0, 0
        async with self.redis.pipeline(transaction=False) as pipe:
            for hid in ids:
                pipe.get(self.keys.kv_lease(as_text(hid)))
            raws = await pipe.execute()
        total = sum(KVHandle.unpack(raw).nbytes for raw in raws if raw is not None)
        return len(ids), total

    async def memory_use(self, max_age: float = 1.0) -> float | None:
        """Redis's used memory as a share of its maxmemory (None: no cap set), read at most
        every `max_age` seconds: the gateway admits by bytes as well as by queued jobs."""
        now = time.monotonic()
        if now - self._memory[0] >= max_age:
            try:
                info = await self.redis.info("memory")
            except ResponseError:  # an ACL user without INFO: admission by jobs only
                info = {}
            cap = int(info.get("maxmemory") or 0)
            use = int(info.get("used_memory") or 0) / cap if cap else None
            self._memory = (now, use)
        return self._memory[1]

    async def prefill_queue_depth(self) -> int:
        return await self._waiting(self.keys.prefill_stream, self.keys.prefill_group)

    async def decode_queue_depth(self, device_class: str) -> int:
        return await self._waiting(self.keys.decode_stream(device_class), self.keys.decode_group)

    async def cancel(self, request_id: str) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:  # two slots
            pipe.set(self.keys.cancel_flag(request_id), 1, ex=max(1, int(self.output_ttl)))
            if self.sharded:
                pipe.spublish(self.keys.cancel_channel, request_id)
            else:
                pipe.publish(self.keys.cancel_channel, request_id)
            await pipe.execute()

    async def workers(self) -> list[dict[str, Any]]:
        """Registered workers alive now (`liveness.is_alive`) with their heartbeat hash (plus
        "id"); ids whose hash expired are pruned from the set."""
        ids = sorted(as_text(i) for i in await self.redis.smembers(self.keys.workers))
        if not ids:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for wid in ids:
                pipe.hgetall(self.keys.worker(wid))
            hashes = await pipe.execute()
        alive, dead = [], []
        now = time.time()
        for wid, h in zip(ids, hashes, strict=True):
            info = {as_text(k): as_text(v) for k, v in h.items()}
            if is_alive(info, now):
                alive.append({"id": wid, **info})
            elif not info:
                dead.append(wid)
        if dead:
            await self.redis.srem(self.keys.workers, *dead)
        return alive

    async def publish_itl_tails(self, source: str, tails: dict[str, tuple[float, int]]) -> None:
        """This gateway's delivered tail per device class (broker/itl_tails.py)."""
        if not tails:
            return
        now = time.time()
        fields = {f"{cls}:{source}": itl_tails.pack(r, n, now) for cls, (r, n) in tails.items()}
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(self.keys.itl_tails, mapping=fields)
        pipe.pexpire(self.keys.itl_tails, itl_tails.TTL_MS)
        await pipe.execute()

    async def ping(self) -> None:
        await self.redis.ping()

    async def request_exists(self, request_id: str) -> bool:
        return bool(await self.redis.exists(self.keys.output_stream(request_id)))

    async def read_output(self, request_id: str, after: str = "-") -> list[tuple[str, TokenEvent]]:
        """(entry id, event) of a request's record after entry id `after` ("-" = all);
        undecodable entries are logged and skipped."""
        start = "-" if after == "-" else token_log.next_id(after)
        entries = await self.redis.xrange(self.keys.output_stream(request_id), min=start)
        return _events(request_id, entries)

    async def follow_output(
        self, request_id: str, after: str, block_s: float
    ) -> list[tuple[str, TokenEvent]]:
        """Like `read_output`, but waits up to `block_s` for a new entry (XREAD BLOCK)."""
        stream = self.keys.output_stream(request_id)
        cursor = "0-0" if after == "-" else after
        block = max(1, int(block_s * 1000))
        reply = await self.redis.xread({stream: cursor}, count=1024, block=block)
        entries = [e for _, rows in reply or [] for e in rows]
        return _events(request_id, entries)

    async def read_gateway(self, gateway: str, start: str) -> list[tuple[str, list[TokenEvent]]]:
        """(entry id, events) of a gateway's stream from entry id `start` on."""
        rows = await self.redis.xrange(self.keys.gateway_stream(gateway), min=start)
        return _entries(gateway, rows)

    async def follow_gateway(
        self, gateway: str, after: str, block_s: float
    ) -> list[tuple[str, list[TokenEvent]]]:
        """(entry id, events) of a gateway's stream after entry id `after`, waiting up to
        `block_s` for one: how a resume follows a request another gateway submitted."""
        stream = self.keys.gateway_stream(gateway)
        block = max(1, int(block_s * 1000))
        reply = await self.redis.xread({stream: after}, count=READ_COUNT, block=block)
        return _entries(gateway, [e for _, rows in reply or [] for e in rows])

    async def request_events(self, request_id: str, origin: str) -> list[TokenEvent]:
        """Every event of a request so far: its record, then its newest tokens from the stream
        of the gateway that submitted it (`origin`; "" = the record only; token_log.merge)."""
        entries = await self.read_output(request_id)
        record = [ev for _, ev in entries]
        if not origin or not entries:
            return record
        rows = await self.read_gateway(origin, token_log.scan_start(entries[-1][0]))
        return token_log.merge(record, [ev for _, evs in rows for ev in evs], request_id)

    # ---- token delivery ----------------------------------------------------------------------
    @property
    def sharded(self) -> bool:
        return clustered(self.redis)

    def subscribe(
        self, request_id: str, after_seq: int = -1, follow: bool = False, origin: str = ""
    ) -> TokenSubscription:
        """Listen for the tokens of `request_id` with seq > after_seq; the reader of this
        gateway's stream starts at the first call. `origin`: the gateway that submitted the
        request, when a resume is served here ("" = this one); `follow`: it may be another's,
        so its events are read from that one's stream, not waited for on ours."""
        if not follow or origin == self.gateway_id:  # ours: our reader gets every event
            origin, follow = self.gateway_id, False
        # origin "" with follow: a record of unknown origin, followed with a blocking XREAD
        sub = TokenSubscription(self, request_id, after_seq, follow, origin)
        self._routes.setdefault(request_id, set()).add(sub)
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read_loop())
        return sub

    def _release(self, sub: TokenSubscription) -> None:
        routes = self._routes.get(sub.request_id)
        if routes is None or sub not in routes:
            return
        routes.discard(sub)
        if not routes:
            del self._routes[sub.request_id]

    async def _read_loop(self) -> None:
        backoff = 0.0
        stream = self.stream
        while not self._closed:
            try:
                reply = await self.redis.xread(
                    {stream: self._cursor}, count=READ_COUNT, block=READ_BLOCK_MS
                )
                backoff = 0.0
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # nothing may stop delivery for every request
                if isinstance(exc, (RedisError, OSError)):
                    if not backoff:
                        log.warning("reading %s failed (%s); retrying", stream, exc)
                else:
                    log.exception("gateway stream reader")
                backoff = min(0.5, max(0.05, backoff * 2))
                await asyncio.sleep(backoff)  # then on from the same entry: nothing is lost
                continue
            for _, rows in reply or ():
                for entry_id, fields in rows:
                    self._cursor = entry_id
                    try:
                        self._route(fields)
                    except Exception:  # one bad entry may not stop delivery for every request
                        log.exception("gateway stream reader: entry %s", entry_id)

    def _route(self, fields: dict) -> None:
        """One worker step's events of this gateway's requests, each to its subscriptions."""
        try:
            events = entry_events(fields)
        except SchemaError as exc:
            log.warning("gateway stream: dropping an entry: %s", exc)
            return
        routes = self._routes
        for event in events:
            for sub in routes.get(event.request_id, ()):
                sub.deliver(event)

    async def aclose(self) -> None:
        self._closed = True
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
        if self.jobs is not None:
            await self.jobs.aclose()


def _events(request_id: str, entries: list | None) -> list[tuple[str, TokenEvent]]:
    """(entry id, event) of output-stream entries; undecodable entries logged and skipped."""
    out = []
    for entry_id, fields in entries or []:
        try:
            out += [(as_text(entry_id), ev) for ev in entry_events(fields)]
        except SchemaError as exc:
            log.warning("output stream %s: skipping entry %s: %s", request_id, entry_id, exc)
    return out


def _entries(gateway: str, rows: list | None) -> list[tuple[str, list[TokenEvent]]]:
    """(entry id, events) of gateway-stream entries; undecodable entries logged and skipped."""
    out = []
    for entry_id, fields in rows or []:
        try:
            out.append((as_text(entry_id), entry_events(fields)))
        except SchemaError as exc:
            log.warning("gateway stream %s: skipping entry %s: %s", gateway, entry_id, exc)
    return out
