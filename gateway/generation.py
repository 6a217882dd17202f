"""One API request in flight: its subscriptions (one per choice), merged into one event feed,
the per-choice state (`syshax.api.choices.Choice`: text, tokens, logprobs, finish reason), its
latency metrics, cancellation, and the non-streaming response."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Any

import anyio
from fastapi import Request
from syshax.api.choices import Choice, completion_body, usage
from syshax.api.errors import APIError, worker_error
from syshax.api.prepare import Plan
from syshax.broker.client import BrokerClient
from syshax.broker.schemas import TokenEvent
from syshax.broker.subscription import TokenSubscription, queue_get
from syshax.shared.tokenizer import Tokenizer

from .errors import REDIS_DOWN
from .metrics import Metrics

log = logging.getLogger(__name__)
DISCONNECT_CHECK = 0.5  # seconds between client-disconnect checks while waiting
LIVENESS_CHECK = 2.0  # seconds without an event before checking that the request still exists
BROKER_OUTAGE_LIMIT = 10.0  # seconds of unreachable Redis after which a waiting request fails


class ClientGone(Exception):
    """The HTTP client disconnected."""


class _Quiet:
    """`Generation.wait`'s answer when no event came for its `quiet_after` seconds."""

    def __repr__(self) -> str:
        return "QUIET"


QUIET = _Quiet()


class Generation:
    """Merges the subscriptions of an API request's choices into one feed of (index, event)."""

    def __init__(
        self,
        broker: BrokerClient,
        metrics: Metrics,
        kind: str,
        request_id: str,
        model: str,
        created: int,
        job_ids: list[str],
        prompt_tokens: int,
        arrival: float,
        deadline: float,
        logprobs: bool = False,
        include_usage: bool = False,
        after: list[int] | None = None,
        tool_format: str = "",
        follow: bool = False,
        origin: str = "",
    ) -> None:
        self.broker, self.metrics = broker, metrics
        self.kind, self.request_id, self.model, self.created = kind, request_id, model, created
        self.prompt_tokens = prompt_tokens
        self.arrival = arrival
        self.deadline = deadline  # unix time
        self.logprobs, self.include_usage = logprobs, include_usage
        self.tool_format = tool_format  # tool calls are read from the finished text
        after = after or [-1] * len(job_ids)
        self.choices = [
            Choice(i, jid, last_seq=s)
            for i, (jid, s) in enumerate(zip(job_ids, after, strict=True))
        ]
        self.subs: list[TokenSubscription] = [
            broker.subscribe(jid, after_seq=s, follow=follow, origin=origin)
            for jid, s in zip(job_ids, after, strict=True)
        ]
        self._queue: asyncio.Queue[tuple[int, TokenEvent | BaseException | None]] = asyncio.Queue()
        self._pumps: list[asyncio.Task[None]] = []
        self._pending: list[tuple[int, TokenEvent]] = []
        self._last_at = [0.0] * len(job_ids)  # monotonic time of each choice's previous token
        self._open = len(job_ids)
        self.first_token_at: float | None = None
        self._checked = time.monotonic()  # last client-disconnect check
        self._alive_checked = time.monotonic()  # last check that the request still exists
        self._down_since: float | None = None  # Redis unreachable since (monotonic)
        self.finished = False  # metrics recorded, nothing left to cancel

    @classmethod
    def for_plan(cls, broker: BrokerClient, metrics: Metrics, plan: Plan) -> Generation:
        return cls(
            broker,
            metrics,
            plan.kind,
            plan.request_id,
            plan.model,
            plan.created,
            plan.job_ids(),
            len(plan.prompt_ids),
            plan.arrival,
            plan.deadline,
            logprobs=plan.logprobs,
            include_usage=plan.include_usage,
            tool_format=plan.tool_format,
        )

    # ---- feed ------------------------------------------------------------------------------
    def start(self) -> None:
        if len(self.subs) == 1:
            return  # read directly: no task, no second queue
        for i, sub in enumerate(self.subs):
            self._pumps.append(asyncio.get_running_loop().create_task(self._pump(i, sub)))

    async def _pump(self, i: int, sub: TokenSubscription) -> None:
        try:
            async for event in sub:
                self._queue.put_nowait((i, event))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._queue.put_nowait((i, exc))
            return
        finally:
            sub.close()
        self._queue.put_nowait((i, None))

    @property
    def all_done(self) -> bool:
        return all(c.done for c in self.choices)

    def push_back(self, item: tuple[int, TokenEvent]) -> None:
        self._pending.append(item)

    async def next_event(self, timeout: float) -> tuple[int, TokenEvent] | None:
        """The next event of any choice, or None after `timeout` seconds (or when every choice
        is done)."""
        if self._pending:
            return self._pending.pop()
        if len(self.subs) == 1:
            sub = self.subs[0]
            event = await sub.get(timeout) if self._open else None
            if event is None:
                self._open = 0 if sub.done else self._open
                return None
            return 0, event
        while self._open > 0:
            try:
                i, item = self._queue.get_nowait()
            except asyncio.QueueEmpty:
                try:
                    i, item = await queue_get(self._queue, timeout)
                except asyncio.TimeoutError:
                    return None
            if isinstance(item, TokenEvent):
                return i, item
            self._open -= 1
            if isinstance(item, BaseException):
                raise item
        return None

    async def wait(
        self, request: Request | None, quiet_after: float = 0.0
    ) -> tuple[int, TokenEvent] | _Quiet | None:
        """Like next_event, but raises APIError(504) at the deadline and ClientGone when the
        client went away; None only when every choice is done. With `quiet_after` > 0, QUIET
        when no event came for that many seconds (the caller keeps the connection alive)."""
        quiet_at = time.monotonic() + quiet_after if quiet_after > 0 else float("inf")
        while True:
            remaining = self.deadline - time.time()
            if remaining <= 0:
                raise APIError(
                    504, "the request timed out (request_timeout)", type="timeout", code="timeout"
                )
            if request is not None and time.monotonic() - self._checked >= DISCONNECT_CHECK:
                self._checked = time.monotonic()
                if await request.is_disconnected():
                    raise ClientGone()
            timeout = min(remaining, DISCONNECT_CHECK, max(0.0, quiet_at - time.monotonic()))
            item = await self.next_event(timeout)
            if item is not None or self._open == 0:
                self._alive_checked = time.monotonic()
                return item
            await self._check_alive()
            if time.monotonic() >= quiet_at:
                return QUIET

    async def _check_alive(self) -> None:
        """After a quiet while, make sure the request still exists: a Redis that restarted
        without its data (or stayed unreachable too long) took the job with it, and no token
        will ever come. Fail then (503, retry) instead of waiting for request_timeout."""
        now = time.monotonic()
        if now - self._alive_checked < LIVENESS_CHECK:
            return
        self._alive_checked = now
        try:
            exists = await self.broker.requests.exists(self.request_id)
        except REDIS_DOWN:
            self._down_since = self._down_since or now
            if now - self._down_since >= BROKER_OUTAGE_LIMIT:
                raise
            return
        self._down_since = None
        if not exists:
            raise APIError(
                503,
                "the request was lost: the message broker (Redis) restarted without it; retry",
                code="request_lost",
                headers={"Retry-After": "1"},
            )

    # ---- state -----------------------------------------------------------------------------
    def apply(self, i: int, event: TokenEvent) -> Choice:
        c = self.choices[i]
        if c.apply(event) and event.token_id >= 0:
            now = time.monotonic()
            if self.first_token_at is None:
                self.first_token_at = now
                self.metrics.ttft.observe(now - self.arrival)
            if self._last_at[i]:
                self.metrics.token_gap(event.worker, now - self._last_at[i], now)
            self._last_at[i] = now
        if self.all_done:
            self.record_finished()
        return c

    def replay(self, i: int, events: Iterable[TokenEvent]) -> None:
        """A resumed stream: take in what its client was sent already (the events up to its
        cursor, from the output stream), so usage counts them and a finished choice is done.
        Nothing of it is sent again, and no latency is measured."""
        c = self.choices[i]
        sent, c.last_seq = c.last_seq, -1
        for event in events:
            if event.seq <= sent:
                c.apply(event)
        c.last_seq = sent

    def cursor(self) -> str:
        """SSE event id: `<request_id>:<last seq of choice 0>,<of choice 1>,...`."""
        if len(self.choices) == 1:
            return f"{self.request_id}:{self.choices[0].last_seq}"
        return f"{self.request_id}:{','.join(str(c.last_seq) for c in self.choices)}"

    def usage(self) -> dict[str, int]:
        return usage(self.prompt_tokens, self.choices)

    def record_finished(self) -> None:
        if self.finished:
            return
        self.finished = True
        self.metrics.e2e.observe(time.monotonic() - self.arrival)
        self.metrics.prompt_tokens.inc(self.prompt_tokens)
        self.metrics.generation_tokens.inc(sum(c.tokens for c in self.choices))

    # ---- ending ----------------------------------------------------------------------------
    async def cancel(self) -> None:
        """Cancel every unfinished choice (shielded: also runs from a cancelled task)."""
        ids = [c.job_id for c in self.choices if not c.done]
        if not ids:
            return
        with anyio.CancelScope(shield=True):
            for jid in ids:
                try:
                    await self.broker.cancel(jid)
                except Exception as exc:  # Redis down: the deadline in the job still applies
                    log.warning("could not cancel %s: %s", jid, exc)

    def close(self) -> None:
        for task in self._pumps:
            task.cancel()
        for sub in self.subs:
            sub.close()

    # ---- non-streaming ---------------------------------------------------------------------
    async def collect(self, request: Request | None) -> None:
        """Consume every event; raise the first worker error as an APIError."""
        while not self.all_done:
            item = await self.wait(request)
            if item is None:
                break
            c = self.apply(*item)
            if c.error is not None:
                raise worker_error(c.error)

    def response(self, tokenizer: Tokenizer) -> dict[str, Any]:
        return completion_body(
            self.kind, self.request_id, self.created, self.model, self.choices,
            self.prompt_tokens, self.logprobs, tokenizer, self.tool_format,
        )  # fmt: skip
