"""Prometheus metrics of one gateway app (own registry, so several apps can live in a process).

Names follow vLLM's (`vllm:time_to_first_token_seconds` -> `syshax:time_to_first_token_seconds`)
so existing dashboards need only the prefix changed.
"""

from __future__ import annotations

from collections.abc import Awaitable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from syshax.broker.keys import DEVICE_CLASSES

from .itl_tails import ItlTails
from .light_histogram import LightHistogram

_LATENCY_BUCKETS = (
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
    0.5, 0.75, 1.0, 2.5, 5.0,
)  # fmt: skip


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "syshax:requests",
            "HTTP requests finished, by endpoint and status code.",
            ["endpoint", "status"],
            registry=r,
        )
        self.running = Gauge(
            "syshax:requests_running", "Generation requests in progress.", registry=r
        )
        self.queue_length = Gauge(
            "syshax:queue_length",
            "Jobs waiting in a work stream (read at scrape time).",
            ["stream"],
            registry=r,
        )
        self.in_flight = Gauge(
            "syshax:queue_pending",
            "Jobs delivered to a worker and not yet acked, per work stream (read at scrape time).",
            ["stream"],
            registry=r,
        )
        # Per served model and device class: a model's dispatcher weighs only its own workers.
        self.workers_running = Gauge(
            "syshax:num_requests_running_by_device",
            "Sequences running on the live workers of a model and device class (heartbeats).",
            ["device_class", "model"],
            registry=r,
        )
        self.workers_waiting = Gauge(
            "syshax:num_requests_waiting_by_device",
            "Sequences waiting inside the live workers of a model and device class (heartbeats).",
            ["device_class", "model"],
            registry=r,
        )
        self.decode_capacity = Gauge(
            "syshax:decode_capacity_by_device",
            "Sequences the live decode workers of a model and device class run at once.",
            ["device_class", "model"],
            registry=r,
        )
        self.kv_leases = Gauge(
            "syshax:kv_leases", "KV-cache leases held across the farm.", registry=r
        )
        self.kv_lease_bytes = Gauge(
            "syshax:kv_lease_bytes", "Bytes of KV cache held by leases across the farm.", registry=r
        )
        self.ttft = Histogram(
            "syshax:time_to_first_token_seconds",
            "Time from request arrival to the first generated token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl_tails = ItlTails()  # the same gaps per worker: the SLO rule's delivered tail
        # Observed per streamed token: Histogram's locked observe cost ~1 us a token of the
        # gateway's ~35-50 (light_histogram.py, ~0.1 us); the exposition is the same.
        self.itl = LightHistogram(
            "syshax:inter_token_latency_seconds",
            "Time between consecutive tokens of a choice, as seen by the gateway.",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "syshax:e2e_request_latency_seconds",
            "Time from request arrival to its last token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "syshax:prompt_tokens", "Prompt tokens of finished requests.", registry=r
        )
        self.generation_tokens = Counter(
            "syshax:generation_tokens", "Tokens generated for finished requests.", registry=r
        )

    def token_gap(self, worker: str, gap: float, now: float) -> None:
        """A choice's token reached the gateway `gap` seconds after its previous one."""
        self.itl.observe(gap)
        self.itl_tails.add(worker, gap, now)

    def set_devices(self, workers: list[dict], models: list[str]) -> None:
        """Sequences running and waiting, and decode capacity, per served model and device
        class from the live heartbeats (`workers`). Every model in `models` (the routes') has
        its rows, 0 while none of its workers lives; a model no longer served loses them."""
        rows = {(cls, model): [0, 0, 0] for model in models for cls in DEVICE_CLASSES}
        for w in workers:
            cls = w.get("device_class")
            if cls not in DEVICE_CLASSES:
                continue
            row = rows.setdefault((cls, str(w.get("model", ""))), [0, 0, 0])
            row[0] += int(w.get("running", 0))
            row[1] += int(w.get("waiting", 0))
            if "decode" in str(w.get("roles", "")).split(","):
                row[2] += int(w.get("capacity", 0))
        for gauge in (self.workers_running, self.workers_waiting, self.decode_capacity):
            gauge.clear()  # no stale series of a model whose workers all left
        for (cls, model), (running, waiting, capacity) in rows.items():
            self.workers_running.labels(cls, model).set(running)
            self.workers_waiting.labels(cls, model).set(waiting)
            self.decode_capacity.labels(cls, model).set(capacity)

    def request_done(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestMetricsMiddleware:
    """Counts finished HTTP requests by endpoint and status code."""

    ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        if path in self.ROUTES:
            endpoint = path
        elif path.startswith("/v1/requests/"):
            endpoint = "/v1/requests/{request_id}/stream"
        else:
            endpoint = "other"
        status = 500

        # A plain function that returns send's awaitable, not a coroutine of its own: it runs
        # for every SSE chunk, and each async wrapper costs a coroutine object and a frame.
        def counting_send(message: Message) -> Awaitable[None]:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            return send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            self.metrics.request_done(endpoint, status)
