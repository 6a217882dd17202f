"""A worker's own /metrics (Prometheus) and /health endpoint, on `xpu.port` / `cpu.port + i`.

Served from a daemon thread with the standard library's HTTP server: the worker loop only
updates counters and gauges (cheap, no I/O), and a scrape never touches the engine.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    generate_latest,
)

log = logging.getLogger(__name__)
STALL_AFTER = 30.0  # seconds without a loop turn before /health reports the worker stalled


class WorkerMetrics:
    def __init__(self, worker_id: str, device_class: str, model: str = ""):
        """`model`: the served model's name (every series carries it, so a farm of several
        models sums capacity, tokens and dispatch decisions per model)."""
        self.registry = CollectorRegistry()
        labels = {"worker": worker_id, "device_class": device_class, "model": model}
        names = list(labels)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"syshax:{name}", doc, names, registry=self.registry).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"syshax:{name}", doc, names, registry=self.registry).labels(**labels)

        self.running = gauge("num_requests_running", "sequences in the engine's running batch")
        self.waiting = gauge("num_requests_waiting", "sequences waiting for a slot in this worker")
        self.capacity = gauge("worker_capacity", "sequences this worker runs at once")
        self.kv_usage = gauge(
            "kv_cache_usage_perc", "share of KV cache blocks held by sequences (0-1)"
        )
        self.decode_tps = gauge(
            "decode_tokens_per_second", "measured decode speed over the last steps"
        )
        self.spec_acceptance = gauge(
            "spec_acceptance_rate",
            "share of speculatively proposed tokens the model accepted, since start (0: none)",
        )
        self.spec_tokens_per_step = gauge(
            "spec_tokens_per_step",
            "tokens a decoding sequence got per engine step, since start (1 without speculation)",
        )
        self.prompt_tokens = counter("prompt_tokens", "prompt tokens prefilled")
        self.generation_tokens = counter("generation_tokens", "tokens generated")
        self.kv_exports = counter("kv_exports", "KV caches handed off to another worker")
        self.kv_imports = counter("kv_imports", "KV caches imported from another worker")
        self.kv_recomputes = counter("kv_recomputes", "sequences resumed by recomputing their KV")
        self.dispatch = Counter(
            "syshax:dispatcher_decisions",
            "dispatcher decisions made here, by the device chosen and the rule that chose it "
            "(broker/dispatcher.py RULES)",
            [*names, "device", "rule"],
            registry=self.registry,
        )
        self.labels = labels
        self.last_turn = time.monotonic()

    def health(self) -> tuple[int, dict]:
        idle = time.monotonic() - self.last_turn
        ok = idle < STALL_AFTER
        return (200 if ok else 503), {
            "status": "ok" if ok else "stalled",
            "seconds_since_loop": round(idle, 1),
            **self.labels,
        }


def serve_metrics(metrics: WorkerMetrics, host: str, port: int) -> ThreadingHTTPServer | None:
    """Start the endpoint; a port that is taken is logged, not fatal (the worker still serves)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            if self.path.startswith("/metrics"):
                body, ctype, status = generate_latest(metrics.registry), CONTENT_TYPE_LATEST, 200
            elif self.path.startswith("/health"):
                status, payload = metrics.health()
                body, ctype = json.dumps(payload).encode(), "application/json"
            else:
                body, ctype, status = b'{"error": "not found"}', "application/json", 404
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:  # scrapes are not worth a log line
            pass

    try:
        server = ThreadingHTTPServer((host, port), Handler)
    except OSError as exc:
        log.error("worker metrics endpoint not started on %s:%d: %s", host, port, exc)
        return None
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server
