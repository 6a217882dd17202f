"""`syshax run`: the whole farm on this host, each part its own process.

Starts an embedded Redis when no `redis.url` is configured, then the gateway, the xPU worker
(prefill + decode; on the CPU when there is no CUDA device) and `cpu.workers` CPU decode
workers, each as `syshax worker ...` / `syshax gateway ...` so one crash does not take the
others down.

The one-host layout (`layout`): with an accelerator, the xPU worker prefills on it and one CPU
decode worker takes the decodes the dispatcher sends to the CPU. With none, a second worker
would only split the same cores into two halves that each read all the weights (measured in
docs/benchmarks.md: the split served less than one worker), so the default is one worker with
both roles on every core; `cpu.workers` / `--cpu-workers` still ask for the split (the PD
pipeline stays testable on any host). A child that exits unexpectedly is restarted with a capped backoff. On Ctrl-C or
SIGTERM it stops in uvicorn's order: the gateway first (no new requests), then the workers
(they drain), then Redis.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

log = logging.getLogger("syshax.run")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        default=None,
        help="config file (default: $SYSHAX_CONFIG or ~/.config/syshax/config.yaml; built-in defaults if absent)",
    )
    p.add_argument(
        "--engine",
        choices=("model", "echo"),
        default="model",
        help="echo = zero-cost stand-in engine, to measure the farm's own overhead (default: %(default)s)",
    )
    p.add_argument(
        "--cpu-workers",
        type=int,
        default=None,
        help="CPU decode workers (default: cpu.workers from the config; when that is null, "
        "1 with an accelerator, 0 without: one worker with both roles on every core)",
    )
    p.add_argument("--no-gateway", action="store_true", help="start only Redis and the workers")


@dataclass
class Child:
    name: str
    argv: list[str]
    proc: subprocess.Popen | None = None
    restarts: int = 0
    next_start: float = 0.0
    started_at: float = field(default=0.0)

    def start(self, env: dict) -> None:
        self.proc = subprocess.Popen(self.argv, env=env)
        self.started_at = time.monotonic()
        log.warning("started %s (pid %d)", self.name, self.proc.pid)


def has_accelerator(device: str) -> bool:
    """Will the xPU worker find a CUDA device? Decided without importing torch (the supervisor
    stays small): the setting, else whether the NVIDIA driver lists a GPU."""
    if device == "cpu":
        return False
    if device.startswith("cuda"):
        return True
    gpus = "/proc/driver/nvidia/gpus"
    return os.path.isdir(gpus) and bool(os.listdir(gpus))


def layout(cfg, cpu_workers: int | None) -> tuple[int, int | None]:
    """(CPU decode workers, threads for the xPU worker or None for its own default)."""
    accel = has_accelerator(cfg.gpu.device)
    n_cpu = cpu_workers if cpu_workers is not None else cfg.cpu.workers
    if n_cpu is None:
        n_cpu = 1 if accel else 0
    threads = None
    if not accel and n_cpu == 0 and cfg.gpu.threads is None:
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        threads = threads or os.cpu_count() or 1
    return n_cpu, threads


def _children(args, cfg, config_path: str | None, url: str) -> list[Child]:
    base = [sys.executable, "-m", "syshax.cli"]
    common = ["--redis-url", url] + (["--config", config_path] if config_path else [])
    n_cpu, xpu_threads = layout(cfg, args.cpu_workers)
    log.warning(
        "layout: xPU-role worker (prefill + decode%s) + %d CPU decode worker(s)",
        f", {xpu_threads} threads" if xpu_threads else "",
        n_cpu,
    )
    workers = [
        Child(
            "xpu-worker",
            base
            + [
                "worker",
                "--roles",
                "prefill,decode",
                "--device-class",
                "gpu",
                "--engine",
                args.engine,
            ]
            + (["--threads", str(xpu_threads)] if xpu_threads else [])
            + common,
        ),
    ]
    for i in range(n_cpu):
        workers.append(
            Child(
                f"cpu-worker-{i}",
                base
                + [
                    "worker",
                    "--roles",
                    "decode",
                    "--device",
                    "cpu",
                    "--device-class",
                    "cpu",
                    "--engine",
                    args.engine,
                    "--port",  # CPU worker i serves /metrics on cpu.port + i
                    str(cfg.cpu.port + i),
                ]
                + common,
            )
        )
    # Offline batches (rq jobs on the batch queue) enter the farm through its batch stream.
    workers.append(Child("batch-worker", base + ["batch", "worker"] + common))
    gateway = [] if args.no_gateway else [Child("gateway", base + ["gateway"] + common)]
    return gateway + workers


def run(args: argparse.Namespace) -> int:
    from syshax.broker.embedded import EmbeddedRedis, EmbeddedRedisError
    from syshax.shared.config import ConfigError, load_config, redact_url

    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        print(f"syshax run: {exc}", file=sys.stderr)
        return 2
    embedded = None
    url = cfg.redis.url
    if not url:
        try:
            embedded = EmbeddedRedis().start()
        except EmbeddedRedisError as exc:
            print(f"syshax run: {exc}", file=sys.stderr)
            return 2
        url = embedded.url
        log.warning("started embedded Redis at %s", url)
    else:
        log.warning("using Redis at %s", redact_url(url))
    from syshax.shared import farm_file
    from syshax.shared.config import resolve_config_path

    gateway_url = f"http://{cfg.conductor.host}:{cfg.conductor.port}/v1"
    published = farm_file.publish(
        resolve_config_path(args.config), cfg.redis.prefix, url, gateway_url
    )
    children = _children(args, cfg, args.config, url)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    env = dict(os.environ)
    print(
        f"sysHAX farm: gateway on http://{cfg.conductor.host}:{cfg.conductor.port}/v1 "
        f"(model loading takes a few seconds; Ctrl-C stops everything)",
        flush=True,
    )
    try:
        for c in children:
            c.start(env)
        _supervise(children, env, stop)
    finally:
        _shutdown(children)
        farm_file.remove(published)
        if embedded is not None:
            embedded.stop()
    return 0


def _supervise(children: list[Child], env: dict, stop: threading.Event) -> None:
    while not stop.wait(0.5):
        now = time.monotonic()
        for c in children:
            if c.proc is not None and c.proc.poll() is not None:
                code = c.proc.returncode
                # A child that ran a while earns a fresh backoff; one that dies at once backs off.
                if now - c.started_at > 60:
                    c.restarts = 0
                delay = min(2**c.restarts, 30)
                log.error("%s exited with %s; restarting in %ds", c.name, code, delay)
                c.proc, c.next_start = None, now + delay
                c.restarts += 1
            if c.proc is None and now >= c.next_start:
                c.start(env)


def _shutdown(children: list[Child]) -> None:
    gateway = [c for c in children if c.name == "gateway"]
    workers = [c for c in children if c.name != "gateway"]
    for group, timeout in ((gateway, 15), (workers, 40)):
        for c in group:
            if c.proc is not None and c.proc.poll() is None:
                c.proc.send_signal(signal.SIGTERM)
        for c in group:
            if c.proc is None:
                continue
            try:
                c.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.error("%s did not stop in %ds; killing it", c.name, timeout)
                c.proc.kill()
                c.proc.wait()
