"""The prefill queue's depth as a gateway's admission sees it, without a Redis round trip per
request (issue 31: each round trip costs Redis CPU, and admission was one per request).

The depth is read at most every `DEPTH_MAX_AGE_S`; between reads, the jobs this gateway queued
since the last read was sent are added to it, so it never under-counts what this gateway queued
(jobs that workers took since are not subtracted: it errs towards refusing). A depth at or over
the limit is read again before a refusal, unless that read ended after the request arrived,
so a 429 is never based on a stale high value. One read at a time: the requests that need one
while it is in flight share it.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable

# How old the depth read may be when a request is admitted. Other gateways' jobs and the
# workers' takes show up only at the next read: 50 ms bounds that blind spot at a few steps'
# worth of queueing, while a gateway admitting hundreds of requests a second reads it ~20
# times a second instead of once per request.
DEPTH_MAX_AGE_S = 0.05


class AdmissionDepth:
    """`depth(limit)`: the queue's depth for admission; `note_submitted()` after each job this
    gateway queues. `read` asks the queue itself (BrokerClient.prefill_queue_depth)."""

    def __init__(
        self, read: Callable[[], Awaitable[int]], max_age: float = DEPTH_MAX_AGE_S
    ) -> None:
        self._read = read
        self.max_age = max_age
        self.submitted = 0  # jobs this gateway queued, ever
        self.reads = 0  # reads sent (the tests count them)
        self._value = 0  # the depth the last read found
        self._base = 0  # `submitted` when that read was sent: the ones after it are added
        self._sent_at = -math.inf  # when that read was sent (time.monotonic): its age
        self._done_at = -math.inf  # when its answer came: whether it is news to a request
        self._pending: asyncio.Task[None] | None = None  # the read in flight, shared

    def note_submitted(self) -> None:
        """A job of this gateway was queued (or may have been: a failed submit counts too)."""
        self.submitted += 1

    def estimate(self) -> int:
        return self._value + self.submitted - self._base

    async def depth(self, limit: int) -> int:
        """The depth to admit a request by: the cached one while fresh, re-read when it is at or
        over `limit` and its read ended before this request arrived."""
        asked = time.monotonic()
        if asked - self._sent_at >= self.max_age:
            await self._refresh()
        depth = self.estimate()
        if depth >= limit and self._done_at < asked:
            # A read in flight now ends after the request arrived: as fresh as a read of its
            # own (Redis runs it between its send and its answer), and shared.
            await self._refresh()
            depth = self.estimate()
        return depth

    async def _refresh(self) -> None:
        """Wait for the read in flight, or a new one. A request that is cancelled meanwhile
        leaves the read to the others (shield)."""
        task = self._pending
        if task is None or task.done():
            task = asyncio.get_running_loop().create_task(self._fetch())
            task.add_done_callback(_retrieve)
            self._pending = task
        await asyncio.shield(task)

    async def _fetch(self) -> None:
        sent, base = time.monotonic(), self.submitted  # jobs finished by now are in the read
        self.reads += 1
        value = await self._read()
        self._value, self._base = value, base
        self._sent_at, self._done_at = sent, time.monotonic()


def _retrieve(task: asyncio.Task[None]) -> None:
    """A failed read whose askers were all cancelled is not logged as never retrieved (the
    next request reads again, and gets the error itself)."""
    if not task.cancelled():
        task.exception()
