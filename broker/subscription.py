"""One request's token events on the gateway, in `seq` order and each exactly once.

A `TokenSubscription` is made by `BrokerClient.subscribe` (broker/client.py), whose pub/sub
reader puts the events of its request on its queue. Duplicates are dropped, and a gap (or
silence for the client's `poll_interval`) is filled from the output stream with XRANGE; a
resumed request (`follow`) reads its output stream with a blocking XREAD instead.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from typing import Any, Protocol

from redis.exceptions import RedisError

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

    def _release(self, sub: TokenSubscription) -> None: ...


class TokenSubscription:
    """Async iterator of one request's `TokenEvent`s, in seq order, each exactly once, ending
    after the event with `finish_reason` or `error`. Use `async with` or call `aclose()`."""

    def __init__(
        self, client: SubscriptionSource, request_id: str, after_seq: int = -1, follow: bool = False
    ) -> None:
        self.client = client
        self.request_id = request_id
        self.next_seq = after_seq + 1
        self.done = False
        self.follow = follow  # wait on the output stream (XREAD BLOCK), not on pub/sub
        self.last_event_at = 0.0  # time.monotonic() of the newest event yielded
        self._queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
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

    async def backfill(self, block_s: float = 0.0) -> bool:
        """Read what the output stream has beyond the last entry read; `block_s` > 0: wait up
        to that long for one."""
        self._quiet_since = asyncio.get_running_loop().time()
        try:
            if block_s > 0:
                entries = await self.client.follow_output(self.request_id, self._cursor, block_s)
            else:
                entries = await self.client.read_output(self.request_id, self._cursor)
        except (RedisError, OSError) as exc:
            log.warning("backfill of %s failed (will retry): %s", self.request_id, exc)
            return False
        for entry_id, event in entries:
            self._cursor = entry_id
            self._take(event)
        return True

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
                if self.follow:
                    wait = 1.0 if deadline is None else min(1.0, deadline - now)
                    if wait <= 0:
                        return None
                    if not await self.backfill(wait):
                        await asyncio.sleep(min(wait, poll))  # Redis down: not a busy loop
                    if not self._buffer and deadline is not None and loop.time() >= deadline:
                        return None
                    continue
                next_poll = self._quiet_since + poll
                if now >= next_poll:  # no progress for a while: maybe a publish was lost
                    await self.backfill()
                    continue
                if deadline is not None and now >= deadline:
                    return None
                wake = next_poll if deadline is None else min(next_poll, deadline)
                try:
                    incoming = await queue_get(self._queue, wake - now)
                except asyncio.TimeoutError:
                    continue
            else:
                incoming = self._queue.get_nowait()
            self._take(incoming)
            if self._buffer and self.next_seq not in self._buffer:
                await self.backfill()  # a gap: something was published that we never got


if sys.version_info >= (3, 11):

    async def queue_get(queue: asyncio.Queue[Any], timeout: float) -> Any:
        async with asyncio.timeout(timeout):  # no extra task per call, unlike wait_for in 3.11
            return await queue.get()

else:  # pragma: no cover

    async def queue_get(queue: asyncio.Queue[Any], timeout: float) -> Any:
        return await asyncio.wait_for(queue.get(), timeout)
