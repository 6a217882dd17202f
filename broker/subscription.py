"""One request's token events on the gateway, in `seq` order and each exactly once.

A `TokenSubscription` is made by `BrokerClient.subscribe` (broker/client.py), whose reader of
the gateway's stream puts the events of its request on its queue. Duplicates are dropped, and a
gap (or silence for the client's `poll_interval`) is filled from the request's record. A
subscription made after its request began (a resume) reads, once, the newest events from the
stream of the gateway that submitted it (`origin`; the record lags up to
token_log.CHECKPOINT_S); one that `follow`s a request of another gateway keeps reading that
gateway's stream with a blocking XREAD (broker/token_log.py).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from typing import Any, Protocol

from redis.exceptions import RedisError

from . import token_log
from .schemas import TokenEvent

log = logging.getLogger(__name__)


class SubscriptionSource(Protocol):
    """What a subscription needs of its `BrokerClient` (a protocol, so this module never
    imports client.py, which imports it)."""

    poll_interval: float

    async def read_output(
        self, request_id: str, after: str = "-"
    ) -> list[tuple[str, TokenEvent]]: ...

    async def follow_output(
        self, request_id: str, after: str, block_s: float
    ) -> list[tuple[str, TokenEvent]]: ...

    async def read_gateway(
        self, gateway: str, start: str
    ) -> list[tuple[str, list[TokenEvent]]]: ...

    async def follow_gateway(
        self, gateway: str, after: str, block_s: float
    ) -> list[tuple[str, list[TokenEvent]]]: ...

    def _release(self, sub: TokenSubscription) -> None: ...


class TokenSubscription:
    """Async iterator of one request's `TokenEvent`s, in seq order, each exactly once, ending
    after the event with `finish_reason` or `error`. Use `async with` or call `aclose()`."""

    def __init__(
        self,
        client: SubscriptionSource,
        request_id: str,
        after_seq: int = -1,
        follow: bool = False,
        origin: str = "",
    ) -> None:
        self.client = client
        self.request_id = request_id
        self.origin = origin  # the id of the gateway whose stream gets the request's events
        self.next_seq = after_seq + 1
        self.done = False
        self.follow = follow  # another gateway's request: read its streams (XREAD BLOCK)
        self.last_event_at = 0.0  # time.monotonic() of the newest event yielded
        self._buffer: dict[int, TokenEvent] = {}  # received, not yet yielded, by seq
        # The reader hands events over by `deliver` (no queue, no task hop): `get` waits on this
        # future only when nothing is buffered.
        self._waiter: asyncio.Future[None] | None = None
        self._arrived = False  # something came since the last gap check
        self._cursor = "-"  # record (output stream) id read up to
        self._origin_cursor = ""  # origin gateway stream id read up to ("" = not read yet)
        # Events before this subscription began went out on the origin's stream unrouted:
        # read them from there once (a follower keeps reading it).
        self._scan_origin = bool(origin) and (follow or after_seq >= 0)
        self._backfill_first = after_seq >= 0
        self._quiet_since: float | None = None  # monotonic time of the last event or backfill

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

    def deliver(self, event: TokenEvent) -> None:
        """The gateway's reader hands over one event of this request."""
        self._take(event)
        self._arrived = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _take(self, event: TokenEvent) -> None:
        if event.seq < self.next_seq:
            if event.finish_reason is not None or event.error is not None:
                self.done = True  # the request ended before where we start: nothing will come
            return
        self._buffer.setdefault(event.seq, event)

    async def backfill(self, block_s: float = 0.0) -> bool:
        """Read what the record has beyond the last entry read, then (a resume) the origin
        gateway's stream; `block_s` > 0: wait up to that long for something new."""
        self._quiet_since = time.monotonic()
        try:
            if self._scan_origin and self._cursor != "-":
                await self._read_record()
                await self._read_origin(block_s)
            elif block_s > 0:
                entries = await self.client.follow_output(self.request_id, self._cursor, block_s)
                self._take_record(entries)
            else:
                await self._read_record()
        except (RedisError, OSError) as exc:
            log.warning("backfill of %s failed (will retry): %s", self.request_id, exc)
            return False
        return True

    async def _read_record(self) -> None:
        self._take_record(await self.client.read_output(self.request_id, self._cursor))

    def _take_record(self, entries: list[tuple[str, TokenEvent]]) -> None:
        for entry_id, event in entries:
            self._cursor = entry_id
            self._take(event)

    async def _read_origin(self, block_s: float) -> None:
        """The request's events in its origin gateway's stream: from a little before its
        record's end at first, then on from there (blocking, for a follower)."""
        if not self._origin_cursor:
            rows = await self.client.read_gateway(self.origin, token_log.scan_start(self._cursor))
        elif block_s > 0:
            rows = await self.client.follow_gateway(self.origin, self._origin_cursor, block_s)
        else:
            return  # a resume of our own request: the reader routes everything after the scan
        for entry_id, events in rows:
            self._origin_cursor = entry_id
            for event in events:
                if event.request_id == self.request_id:
                    self._take(event)
        if not self._origin_cursor:
            self._origin_cursor = token_log.scan_start(self._cursor)
        if not self.follow:
            self._scan_origin = False

    async def __anext__(self) -> TokenEvent:
        event = await self.get()
        if event is None:
            raise StopAsyncIteration
        return event

    def get_nowait(self) -> TokenEvent | None:
        """The next event if it is here already (None: wait with `get`)."""
        if self._backfill_first:
            return None
        event = self._buffer.pop(self.next_seq, None)
        return None if event is None else self._yield(event)

    async def get(self, timeout: float | None = None) -> TokenEvent | None:
        """The next event; None when the request has ended, or after `timeout` seconds without
        one (then call again: nothing is lost)."""
        if self._backfill_first:
            self._backfill_first = False
            await self.backfill()
        event = self._buffer.pop(self.next_seq, None)
        if event is not None:  # the usual case while a stream runs: no clock, no loop
            return self._yield(event)
        now = time.monotonic()
        deadline = None if timeout is None else now + timeout
        if self._quiet_since is None:
            self._quiet_since = now
        poll = self.client.poll_interval
        while True:
            event = self._buffer.pop(self.next_seq, None)
            if event is not None:
                return self._yield(event)
            if self.done:
                self.close()
                return None
            if self._buffer and self._arrived:
                self._arrived = False
                await self.backfill()  # a gap: something came that we never got before it
                continue
            now = time.monotonic()
            if self.follow:
                wait = 1.0 if deadline is None else min(1.0, deadline - now)
                if wait <= 0:
                    return None
                if not await self.backfill(wait):
                    await asyncio.sleep(min(wait, poll))  # Redis down: not a busy loop
                late = deadline is not None and time.monotonic() >= deadline
                if late and self.next_seq not in self._buffer:
                    return None
                continue
            next_poll = self._quiet_since + poll
            if now >= next_poll:  # no progress for a while: look at the record
                await self.backfill()
                continue
            if deadline is not None and now >= deadline:
                return None
            await self._wait((next_poll if deadline is None else min(next_poll, deadline)) - now)

    def _yield(self, event: TokenEvent) -> TokenEvent:
        self.next_seq += 1
        self.last_event_at = self._quiet_since = time.monotonic()
        if event.finish_reason is not None or event.error is not None:
            self.done = True
            self._buffer.clear()
            self.close()
        return event

    async def _wait(self, delay: float) -> None:
        """Until the reader delivers something or `delay` seconds pass."""
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        timer = loop.call_later(delay, _wake, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


if sys.version_info >= (3, 11):

    async def queue_get(queue: asyncio.Queue[Any], timeout: float) -> Any:
        async with asyncio.timeout(timeout):  # no extra task per call, unlike wait_for in 3.11
            return await queue.get()

else:  # pragma: no cover

    async def queue_get(queue: asyncio.Queue[Any], timeout: float) -> Any:
        return await asyncio.wait_for(queue.get(), timeout)
