"""The gateway's request handling: admission, queueing a request's jobs, streaming or collecting
its tokens, resuming a stream, and the per-second ITL tails (one `Gateway` per app, made by
`create_app` in app.py, the routes in routes.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from typing import Any

import redis.asyncio as aioredis
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from syshax.api.errors import APIError, worker_error
from syshax.api.prepare import Plan, job_ids
from syshax.broker.client import BrokerClient
from syshax.broker.connect import async_client
from syshax.broker.job_transport import AsyncJobs
from syshax.broker.keys import Keys
from syshax.shared.tokenizer import Tokenizer

from .errors import REDIS_DOWN
from .generation import QUIET, ClientGone, Generation
from .metrics import Metrics
from .model_routes import ModelRoute, Router, build_routes
from .settings import GatewaySettings
from .streaming import SSE_HEADERS, parse_event_id, sse

log = logging.getLogger(__name__)


def make_redis(url: str) -> aioredis.Redis:
    """A client that fails fast when Redis is down (the gateway answers 503, it does not hang);
    a cluster client when `url` names a node of a Redis Cluster (broker/connect.py)."""
    return async_client(
        url,
        socket_connect_timeout=2.0,
        socket_timeout=10.0,
        retry=Retry(ExponentialBackoff(cap=0.25, base=0.05), 1),
        # redis-py's default pool holds 100 connections and refuses the 101st ("Too many
        # connections", a 503): 256 streams arriving at once each need one for admission.
        max_connections=REDIS_CONNECTIONS,
    )


REDIS_CONNECTIONS = 4096


# Share of Redis's maxmemory past which new requests get 429: the rest is room for the tokens
# and KV of the requests already admitted.
MEMORY_ADMIT_LIMIT = 0.9
ITL_TAILS_EVERY_S = 1.0  # how often a gateway publishes its delivered tails


class Gateway:
    """Everything a request handler needs; one per app (app.state.gateway)."""

    def __init__(self, settings: GatewaySettings, tokenizer: Tokenizer, redis: Any) -> None:
        self.settings = settings
        # One route per served model (config `models:`), the default first: its tokenizer,
        # checks and job streams. The default's stand for the gateway where one is needed.
        self.router = Router(build_routes(settings, Keys(prefix=settings.key_prefix), tokenizer))
        default = self.router.default
        self.tokenizer, self.preparer = default.tokenizer, default.preparer
        self.max_model_len = default.max_model_len
        self.keys = default.keys
        self.metrics = Metrics()
        self._given_redis = redis
        self.redis: Any = None
        self.broker: BrokerClient | None = None
        self.tasks: set[asyncio.Task[Any]] = set()
        self._tails_task: asyncio.Task[None] | None = None
        # /health found the broker unreachable (status.py): it logs an outage once, not per probe
        self.broker_down = False

    async def start(self) -> None:
        self.redis = self._given_redis or make_redis(self.settings.redis_url)
        s = self.settings
        for route in self.router.routes:  # each model's jobs on its own streams
            jobs = AsyncJobs(route.keys, s.amqp_url) if s.jobs == "amqp" else None
            route.broker = BrokerClient(self.redis, route.keys, s.output_ttl, s.poll_interval, jobs)
        self.broker = self.router.default.broker
        self._tails_task = asyncio.get_running_loop().create_task(self._publish_itl_tails())

    async def _publish_itl_tails(self) -> None:
        """Each second: the tails this gateway delivered per device class, for the dispatcher's
        SLO rule (broker/itl_tails.py). Redis being down only skips a second."""
        source = f"{socket.gethostname()}:{os.getpid()}:{id(self):x}"
        while True:
            await asyncio.sleep(ITL_TAILS_EVERY_S)
            try:
                assert self.broker is not None
                workers = await self.broker.workers()
                classes = {w["id"]: w.get("device_class", "") for w in workers if "id" in w}
                tails = self.metrics.itl_tails.tails(classes, time.monotonic())
                await self.broker.publish_itl_tails(source, tails)
            except REDIS_DOWN:
                continue
            except Exception:  # noqa: BLE001 - a bad heartbeat must not stop the publishing
                log.exception("publishing the delivered ITL tails failed")

    async def stop(self) -> None:
        if self._tails_task is not None:
            self._tails_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._tails_task
        if self.tasks:  # disconnected streams waiting out their grace period
            await asyncio.wait(list(self.tasks), timeout=self.settings.disconnect_grace + 2)
        for route in self.router.routes:
            if route.broker is not None:
                await route.broker.aclose()
        if self._given_redis is None and self.redis is not None:
            await self.redis.aclose()

    def spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def retry_headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.settings.retry_after)}

    # ---- generation ------------------------------------------------------------------------
    async def run(self, request: Request, plan: Plan, route: ModelRoute | None = None) -> Response:
        """Queue `plan` on its model's streams (`route`; None = the default model's) and
        answer with its tokens."""
        route = route or self.router.default
        broker = route.broker
        assert broker is not None
        # The queue's depth cached for up to 50 ms plus this gateway's own jobs since (not a
        # round trip per request); re-read before a refusal (broker/queue_depth.py).
        depth = await broker.admission.depth(self.settings.max_queue_depth)
        if depth >= self.settings.max_queue_depth:
            raise APIError(
                429,
                f"the server is busy ({depth} requests waiting); retry later",
                code="queue_full",
                headers=self.retry_headers(),
            )
        memory = await self.broker.memory_use()
        if memory is not None and memory >= MEMORY_ADMIT_LIMIT:
            # Past maxmemory every write fails (noeviction): refuse whole requests before
            # that, rather than start ones whose tokens could not be delivered.
            raise APIError(
                429,
                f"the server is busy (its message broker is {memory:.0%} full); retry later",
                code="memory_full",
                headers=self.retry_headers(),
            )
        # Subscribed before any job is queued: no token can be published before we listen.
        gen = Generation.for_plan(broker, self.metrics, plan)
        try:
            ttl = int(self.settings.request_timeout + self.settings.output_ttl)
            # `gateway`: whose stream gets its tokens, for a resume served by another gateway
            info = {**plan.info(), "gateway": broker.gateway_id}
            await broker.save_and_submit(plan.job(), info, ttl)  # one round trip for both
        except BaseException:
            gen.close()
            raise
        self.metrics.running.inc()
        gen.start()
        if not plan.stream:
            try:
                await gen.collect(request)
            except ClientGone:
                await gen.cancel()
                return Response(status_code=499)  # nobody is listening
            except BaseException:
                await gen.cancel()
                raise
            finally:
                gen.close()
                self.metrics.running.dec()
                self.spawn(self.ended(plan.request_id))
            return JSONResponse(gen.response(route.tokenizer))
        # Streaming: wait for the first event, so a failure before any byte is a real HTTP
        # error (status + OpenAI body), never a 200 with an error inside; but not longer than
        # the keep-alive interval: a request that waits in a queue gets its response started
        # (and kept alive) rather than a connection silent until a proxy's idle timeout cuts it.
        keepalive = self.settings.sse_keepalive
        try:
            item = await gen.wait(request, quiet_after=keepalive)
            if item is QUIET:
                item = None
            elif item is not None and item[1].error is not None:
                gen.apply(*item)
                raise worker_error(item[1].error)
        except BaseException as exc:
            await gen.cancel()
            gen.close()
            self.metrics.running.dec()
            if isinstance(exc, ClientGone):
                return Response(status_code=499)
            raise
        if item is not None:
            gen.push_back(item)
        return self.stream(gen, send_roles=True, attach=0, tokenizer=route.tokenizer)

    def stream(
        self, gen: Generation, send_roles: bool, attach: int, tokenizer: Tokenizer
    ) -> StreamingResponse:
        ended = False

        def on_end(status: int) -> None:
            nonlocal ended
            if not ended:
                ended = True
                self.metrics.running.dec()
                if status != 499:
                    self.spawn(self.ended(gen.request_id))

        def on_disconnect() -> None:
            on_end(499)
            self.spawn(self.detached(gen, attach))

        body = sse(gen, tokenizer, send_roles, on_disconnect, on_end, self.settings.sse_keepalive)
        return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)

    async def detached(self, gen: Generation, attach: int) -> None:
        """A streaming client went away: cancel its request, unless a resume takes it over
        within the grace period."""
        grace = self.settings.disconnect_grace
        if grace > 0:
            await asyncio.sleep(grace)
            try:
                now = await self.broker.requests.attach_count(gen.request_id)
                if now is not None and now != attach:
                    return
            except REDIS_DOWN:
                pass
        await gen.cancel()
        await self.ended(gen.request_id)

    async def ended(self, request_id: str) -> None:
        """The request is over (done, failed or cancelled): its resume info is kept as long as
        its output (`output_ttl`), and marked, so a resume after the output expired is a 404."""
        # Redis down: the info still expires with request_timeout + output_ttl
        with contextlib.suppress(REDIS_DOWN):
            await self.broker.requests.end(request_id, int(self.settings.output_ttl))

    async def resume(self, request: Request, request_id: str) -> StreamingResponse:
        assert self.broker is not None
        info, ended = await self.broker.requests.load(request_id)
        gone = APIError(
            404,
            f"no request {request_id!r} (unknown, or its output expired)",
            param="request_id",
            code="request_not_found",
        )
        if info is None:
            raise gone
        n = int(info["n"])
        over = ended or time.time() > float(info["deadline"])
        # Over: what is left to serve is its output stream, if it has not expired yet.
        if over and not any([await self.broker.request_exists(j) for j in job_ids(request_id, n)]):
            raise gone
        last = request.headers.get("last-event-id") or request.query_params.get("last_event_id")
        after = parse_event_id(last, request_id, n) if last else [-1] * n
        attach = await self.broker.requests.attach(request_id)
        gen = Generation(
            self.broker,
            self.metrics,
            info["kind"],
            request_id,
            info["model"],
            int(info["created"]),
            job_ids(request_id, n),
            int(info["prompt_tokens"]),
            time.monotonic(),
            float(info["deadline"]),
            logprobs=bool(info["logprobs"]),
            include_usage=bool(info["include_usage"]),
            tool_format=str(info.get("tool_format") or ""),
            after=after,
            follow=True,  # maybe another gateway's request: its stream gets the tokens
            origin=str(info.get("gateway") or ""),
        )
        gen.first_token_at, gen.finished = 0.0, True  # the first request recorded the metrics
        try:
            for c in gen.choices:  # what was already sent counts in usage
                if c.last_seq >= 0:
                    events = await self.broker.request_events(c.job_id, gen.subs[c.index].origin)
                    gen.replay(c.index, events)
        except BaseException:
            gen.close()
            raise
        self.metrics.running.inc()
        gen.start()
        tokenizer = self.router.of_name(str(info["model"])).tokenizer
        return self.stream(gen, send_roles=not last, attach=attach, tokenizer=tokenizer)
