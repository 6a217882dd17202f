"""A worker process's life, from its settings (settings.py): its priority and threads, its
engine (build.py), its metrics endpoint, and the worker loop (worker.py) kept alive across
Redis outages. `syshax worker` parses its options and calls `run_worker`."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time

from .settings import Priority, WorkerSettings

log = logging.getLogger("syshax.worker")
MAX_BACKOFF = 10.0  # seconds between reconnection attempts while Redis is down, at most
STABLE_S = 30.0  # connected this long: the backoff starts again from its shortest wait


def run_worker(settings: WorkerSettings, redis_url: str, drain_timeout: float = 30.0) -> int:
    """Prepare the process, build the engine and serve until SIGTERM/SIGINT; the exit code
    (2: the engine or the kernels cannot start, the reason logged in one line)."""
    from .build import build_engine
    from .engine.errors import EngineError

    try:
        prepare(settings)
    except Exception as exc:  # noqa: BLE001 - a kernel build failure or a refused pinning
        log.error("%s", exc)
        return 2
    try:
        engine = build_engine(settings)
    except EngineError as exc:
        log.error("%s", exc)
        return 2
    if settings.engine == "native":
        from .engine.engine import freeze_loaded_heap

        freeze_loaded_heap()  # the engine lives as long as this process
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    serve(engine, settings, redis_url, stop, drain_timeout)
    return 0


def prepare(settings: WorkerSettings) -> None:
    """Before the engine loads: a CPU decode worker's priority (its threads inherit it), torch's
    threads for a model on the CPU, the kernel threads pinned (before the weights load, so
    their first touch lands on the right NUMA node)."""
    if settings.priority is not None:
        below_the_farm(settings.priority)
    if settings.device == "cpu" and settings.engine == "native":
        import torch

        torch.set_num_threads(settings.threads)
    if settings.kernels is not None:
        from .cpu.options import pin_threads

        pin_threads(settings.kernels)


def below_the_farm(priority: Priority) -> None:
    """A CPU decode worker's priority below the farm's other processes (before its threads
    start: they inherit it). On shared cores the xPU worker's loop otherwise waits for a
    kernel thread's time slice, and every xPU stream's step with it: SCHED_IDLE (cpu.sched_idle)
    yields at once, nice 10 within a slice (docs/benchmarks.md, 2026-12-06: the xPU's streams
    delivered 680 tok/s in `auto` at nice 10, 709-723 under SCHED_IDLE, 797-801 alone)."""
    # Linux keeps both per thread: the threads already started (the tokenizer's, the
    # metrics server's) are set one by one; the ones started later inherit it.
    try:
        threads = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        threads = [0]
    if priority.sched_idle and hasattr(os, "SCHED_IDLE"):
        try:
            for tid in threads:
                with contextlib.suppress(ProcessLookupError):  # a thread that just ended
                    os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            return
        except OSError as exc:
            log.warning("SCHED_IDLE refused (%s); running at nice %d instead", exc, priority.nice)
    if priority.nice:
        for tid in threads:
            with contextlib.suppress(ProcessLookupError):
                os.setpriority(
                    os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + priority.nice
                )


def serve(
    engine, s: WorkerSettings, redis_url: str, stop: threading.Event, drain_timeout: float
) -> None:
    """The worker loop until `stop`; while Redis is down, keep the engine (loading it is the
    slow part) and retry with a capped exponential backoff, never crash-loop."""
    import redis
    from syshax.broker.connect import sync_client
    from syshax.broker.keys import Keys

    from . import loop_trace
    from .metrics import WorkerMetrics, serve_metrics
    from .worker import Worker

    opts, dispatcher = worker_options(s), dispatcher_of(s)
    metrics = WorkerMetrics(s.worker_id, s.device_class, s.served_model)
    if s.metrics_port:
        serve_metrics(metrics, s.metrics_host, s.metrics_port)
    r = sync_client(redis_url, health_check_interval=10)  # a cluster's when it is one
    backoff, connected_at = 0.5, 0.0
    worker = None
    while not stop.is_set():
        try:
            if worker is not None:
                worker.cancels.close()  # the lost connection's pub/sub
                worker.streams.close()  # RabbitMQ redelivers the jobs it held
            worker = None
            worker = Worker(
                engine, r, opts, dispatcher, Keys(s.config.redis.prefix, s.stream_model), metrics
            )
            loop_trace.install(worker)  # only with SYSHAX_LOOP_TRACE set (a benchmark's)
            connected_at = time.monotonic()
            log.info("worker %s ready: %s", s.worker_id, ready_line(s))
            worker.serve(stop, drain_timeout=drain_timeout)
            return
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            if connected_at and time.monotonic() - connected_at > STABLE_S:
                backoff = 0.5  # it had been up a while: a new outage starts with short waits
            connected_at = 0.0
            log.warning("Redis unreachable (%s); retrying in %.1fs", exc, backoff)
            for rid in engine.request_ids():  # their entries stay pending: others reclaim them
                engine.abort(rid)
            stop.wait(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF)


def worker_options(s: WorkerSettings):
    from .worker_options import WorkerOptions

    opts = WorkerOptions(
        worker_id=s.worker_id,
        roles=s.roles,
        device_class=s.device_class,
        device=s.device,
        served_model=s.served_model,
        kv_store=s.config.kv.store,
        kv_ttl=s.config.kv.ttl,
        output_ttl=s.config.output.ttl,
        handoff_slots=s.handoff_slots,
        jobs=s.config.broker.jobs,
        amqp_url=s.config.broker.amqp_url or "",
    )
    if s.heartbeat_ttl is not None:
        opts.heartbeat_ttl = s.heartbeat_ttl
    return opts


def dispatcher_of(s: WorkerSettings):
    """Where this worker's prefills send their decodes: the config's decode_device,
    auto_pd_offload and slo.itl_ms."""
    from syshax.broker.dispatcher import Dispatcher

    cfg = s.config
    return Dispatcher(
        auto_pd_offload=cfg.auto_pd_offload,
        cpu_max_batch_size=cfg.cpu_max_batch_size,
        decode_device=cfg.decode_device,
        slo_itl_s=cfg.slo_itl_s,
    )


def ready_line(s: WorkerSettings) -> str:
    """The worker's ready line: its roles, device, class, slots and how it dispatches."""
    slots = f"{s.slots} (+{s.handoff_slots} to prefill for the CPU)" if s.handoff_slots else s.slots
    line = (
        f"roles={','.join(sorted(s.roles))} device={s.device} class={s.device_class} slots={slots}"
    )
    if "prefill" in s.roles:
        cfg = s.config
        device = "xpu" if not cfg.auto_pd_offload else cfg.decode_device
        slo = f", slo.itl_ms={cfg.slo.itl_ms:g}" if cfg.slo.itl_ms is not None else ""
        line += f"; decodes: decode_device={device}{slo}"
    return line
