"""The gateway's side of the broker (redis.asyncio): submit jobs, receive tokens, cancel.

Token delivery is pub/sub (fast, lossy) backed by the per-request output stream (authoritative),
see `schemas.py` for the wire format. One pub/sub connection per `BrokerClient` carries every
request's channel; its reader task routes messages to per-request queues. A `TokenSubscription`
yields each `TokenEvent` exactly once and in `seq` order: duplicates are dropped, and a gap (or
silence for `poll_interval`) is filled from the output stream with XRANGE.

The Redis client must be created with `decode_responses=False` (messages are msgpack bytes).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from . import itl_tails
from .keys import KEYS, Keys
from .liveness import is_alive
from .request_info import RequestInfo
from .schemas import KVHandle, PrefillJob, SchemaError, TokenEvent

log = logging.getLogger(__name__)

SUBSCRIBE_WAIT = 2.0  # most seconds submit() waits for a SUBSCRIBE confirmation


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


class BrokerClient:
    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys = KEYS,
        output_ttl: int = 600,
        poll_interval: float = 0.5,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.requests = RequestInfo(redis, keys)  # the resume record of each request
        self.output_ttl = output_ttl
        self.poll_interval = poll_interval
        self._pubsub: Any = None
        self._reader: asyncio.Task[None] | None = None
        self._routes: dict[bytes, set[TokenSubscription]] = {}  # channel -> live subscriptions
        self._ready: dict[bytes, asyncio.Event] = {}  # channel -> SUBSCRIBE confirmed
        self._lock = asyncio.Lock()  # serialises SUBSCRIBE/UNSUBSCRIBE on the shared connection
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False
        self._memory: tuple[float, float | None] = (0.0, None)  # (read at, memory_use)

    # ---- jobs and cancellation -------------------------------------------------------------
    async def submit(self, job: PrefillJob) -> None:
        """Queue a prefill job. If the request has a subscription, wait (briefly) until Redis
        confirmed it, so no token is published before we listen."""
        ready = self._ready.get(self.keys.token_channel(job.request_id).encode())
        if ready is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                # The stream covers anything pub/sub misses, so never wait forever.
                await asyncio.wait_for(ready.wait(), SUBSCRIBE_WAIT)
        await self.redis.xadd(self.keys.prefill_stream, {"j": job.pack()})

    async def _waiting(self, stream: str, group: str) -> int:
        return (await self.stream_stats(stream, group))[0]

    async def stream_stats(self, stream: str, group: str) -> tuple[int, int]:
        """(waiting, in flight) of a work stream: entries not yet delivered to a worker, and
        entries delivered but not acked (workers XDEL after XACK, so XLEN = the sum)."""
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
                pipe.get(self.keys.kv_lease(_text(hid)))
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
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(self.keys.cancel_flag(request_id), 1, ex=max(1, int(self.output_ttl)))
            pipe.publish(self.keys.cancel_channel, request_id)
            await pipe.execute()

    async def workers(self) -> list[dict[str, Any]]:
        """Registered workers alive now (`liveness.is_alive`) with their heartbeat hash (plus
        "id"); ids whose hash expired are pruned from the set."""
        ids = sorted(_text(i) for i in await self.redis.smembers(self.keys.workers))
        if not ids:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for wid in ids:
                pipe.hgetall(self.keys.worker(wid))
            hashes = await pipe.execute()
        alive, dead = [], []
        now = time.time()
        for wid, h in zip(ids, hashes, strict=True):
            info = {_text(k): _text(v) for k, v in h.items()}
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
        """(stream id, event) of the output stream after stream id `after` ("-" = all);
        undecodable entries are logged and skipped."""
        start = "-" if after == "-" else _next_id(after)
        entries = await self.redis.xrange(self.keys.output_stream(request_id), min=start)
        out = []
        for entry_id, fields in entries or []:
            raw = fields.get(b"e", fields.get("e"))
            try:
                out.append((_text(entry_id), TokenEvent.unpack(raw)))
            except SchemaError as exc:
                log.warning("output stream %s: skipping entry %s: %s", request_id, entry_id, exc)
        return out

    # ---- token delivery ----------------------------------------------------------------------
    def subscribe(self, request_id: str, after_seq: int = -1) -> TokenSubscription:
        """Listen for the tokens of `request_id` with seq > after_seq. The SUBSCRIBE is sent at
        once (in a task); `submit()` of the same request waits for its confirmation."""
        sub = TokenSubscription(self, request_id, after_seq)
        channel = self.keys.token_channel(request_id).encode()
        sub._channel = channel
        routes = self._routes.setdefault(channel, set())
        routes.add(sub)
        if len(routes) == 1:
            self._ready[channel] = asyncio.Event()
            self._spawn(self._subscribe(channel))
        return sub

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _subscribe(self, channel: bytes) -> None:
        try:
            async with self._lock:
                if channel not in self._routes:  # closed before we got here
                    return
                if self._pubsub is None:
                    self._pubsub = self.redis.pubsub()
                await self._pubsub.subscribe(channel)
                if self._reader is None or self._reader.done():
                    self._reader = asyncio.get_running_loop().create_task(self._read_loop())
        except (RedisError, OSError) as exc:
            # Pub/sub is only the fast path: the subscription polls the stream meanwhile, and
            # the reader re-subscribes every channel when it reconnects.
            log.warning("SUBSCRIBE %s failed (falling back to polling): %s", channel, exc)
            ready = self._ready.get(channel)
            if ready is not None:
                ready.set()

    async def _unsubscribe(self, channel: bytes) -> None:
        async with self._lock:
            if channel in self._routes or self._pubsub is None:
                return  # subscribed again meanwhile
            with contextlib.suppress(RedisError, OSError):
                await self._pubsub.unsubscribe(channel)

    def _release(self, sub: TokenSubscription) -> None:
        routes = self._routes.get(sub._channel)
        if routes is None or sub not in routes:
            return
        routes.discard(sub)
        if not routes:
            del self._routes[sub._channel]
            self._ready.pop(sub._channel, None)
            if not self._closed:
                with contextlib.suppress(RuntimeError):  # no running loop (interpreter exit)
                    self._spawn(self._unsubscribe(sub._channel))

    async def _read_loop(self) -> None:
        backoff = 0.0
        while not self._closed:
            try:
                # reconnects (and re-subscribes every channel) when the connection was lost
                msg = await self._pubsub.get_message(timeout=1.0)
                backoff = 0.0
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # nothing may stop delivery for every request
                if isinstance(exc, (RedisError, OSError)):
                    if not backoff:
                        log.warning("pub/sub connection lost (%s); polling until it is back", exc)
                else:
                    log.exception("pub/sub reader")
                backoff = min(2.0, max(0.05, backoff * 2))
                await asyncio.sleep(backoff)
                continue
            if not msg:
                continue
            kind, channel = msg.get("type"), msg.get("channel")
            if isinstance(channel, str):
                channel = channel.encode()
            if kind == "message":
                for sub in self._routes.get(channel, ()):
                    sub._queue.put_nowait(msg["data"])
            elif kind == "subscribe":
                ready = self._ready.get(channel)
                if ready is not None:
                    ready.set()

    async def aclose(self) -> None:
        self._closed = True
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
        for task in list(self._tasks):
            task.cancel()
        if self._pubsub is not None:
            with contextlib.suppress(RedisError, OSError):
                await self._pubsub.aclose()


class TokenSubscription:
    """Async iterator of one request's `TokenEvent`s, in seq order, each exactly once, ending
    after the event with `finish_reason` or `error`. Use `async with` or call `aclose()`."""

    def __init__(self, client: BrokerClient, request_id: str, after_seq: int = -1) -> None:
        self.client = client
        self.request_id = request_id
        self.next_seq = after_seq + 1
        self.done = False
        self.last_event_at = 0.0  # time.monotonic() of the newest event yielded
        self._channel = b""
        self._queue: asyncio.Queue[bytes] = asyncio.Queue()
        self._buffer: dict[int, TokenEvent] = {}  # received ahead of next_seq
        self._cursor = "-"  # output-stream id read up to
        self._backfill_first = after_seq >= 0
        self._quiet_since: float | None = None  # loop time of the last message or backfill

    def __aiter__(self) -> TokenSubscription:
        return self

    async def __aenter__(self) -> TokenSubscription:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        """Stop listening (idempotent; safe to call from sync code and finalizers)."""
        self.client._release(self)

    def _take(self, event: TokenEvent) -> None:
        if event.seq < self.next_seq:
            if event.finish_reason is not None or event.error is not None:
                self.done = True  # the request ended before where we start: nothing will come
            return
        self._buffer.setdefault(event.seq, event)

    async def backfill(self) -> None:
        """Read what the output stream has beyond the last entry read."""
        self._quiet_since = asyncio.get_running_loop().time()
        try:
            entries = await self.client.read_output(self.request_id, self._cursor)
        except (RedisError, OSError) as exc:
            log.warning("backfill of %s failed (will retry): %s", self.request_id, exc)
            return
        for entry_id, event in entries:
            self._cursor = entry_id
            self._take(event)

    async def __anext__(self) -> TokenEvent:
        event = await self.get()
        if event is None:
            raise StopAsyncIteration
        return event

    async def get(self, timeout: float | None = None) -> TokenEvent | None:
        """The next event; None when the request has ended, or after `timeout` seconds without
        one (then call again: nothing is lost)."""
        if self._backfill_first:
            self._backfill_first = False
            await self.backfill()
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        if self._quiet_since is None:
            self._quiet_since = loop.time()
        poll = self.client.poll_interval
        while True:
            event = self._buffer.pop(self.next_seq, None)
            if event is not None:
                self.next_seq += 1
                self.last_event_at = time.monotonic()
                self._quiet_since = loop.time()
                if event.finish_reason is not None or event.error is not None:
                    self.done = True
                    self._buffer.clear()
                    self.close()
                return event
            if self.done:
                self.close()
                return None
            if self._queue.empty():
                now = loop.time()
                next_poll = self._quiet_since + poll
                if now >= next_poll:  # no progress for a while: maybe a publish was lost
                    await self.backfill()
                    continue
                if deadline is not None and now >= deadline:
                    return None
                wake = next_poll if deadline is None else min(next_poll, deadline)
                try:
                    data = await queue_get(self._queue, wake - now)
                except asyncio.TimeoutError:
                    continue
            else:
                data = self._queue.get_nowait()
            try:
                incoming = TokenEvent.unpack(data)
            except SchemaError as exc:
                log.warning("token channel of %s: dropping message: %s", self.request_id, exc)
                continue
            self._take(incoming)
            if self._buffer and self.next_seq not in self._buffer:
                await self.backfill()  # a gap: something was published that we never got


def _next_id(entry_id: str) -> str:
    """The smallest stream id after `entry_id` (an exclusive start that Redis < 6.2 takes too)."""
    ms, _, seq = entry_id.partition("-")
    return f"{ms}-{int(seq or 0) + 1}"


if sys.version_info >= (3, 11):

    async def queue_get(queue: asyncio.Queue[bytes], timeout: float) -> bytes:
        async with asyncio.timeout(timeout):  # no extra task per call, unlike wait_for in 3.11
            return await queue.get()

else:  # pragma: no cover

    async def queue_get(queue: asyncio.Queue[bytes], timeout: float) -> bytes:
        return await asyncio.wait_for(queue.get(), timeout)
