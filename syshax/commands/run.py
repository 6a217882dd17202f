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
pipeline stays testable on any host). An emulated accelerator (`gpu.engine: emulated` or
`--engine emulated`: the xPU worker sleeps for a profile's step times and runs no model) counts
as an accelerator: by default one real CPU decode worker beside it, so a GPU host's dispatch
runs on a host without one. With `gpu.engine: vllm` (`--engine vllm`) vLLM is the xPU worker's
engine: every worker runs with this Python (`sys.executable`), so run `syshax run` from the
venv that has vLLM (docs/vllm.md); the layout is the native engine's (an accelerator when
`gpu.device` finds one). A child that exits unexpectedly is restarted with a capped backoff.
On Ctrl-C or SIGTERM it stops in uvicorn's order: the gateway first (no new requests), then the
workers (they drain), then Redis.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from syshax.commands.supervisor import Child, Supervisor

log = logging.getLogger("syshax.run")

# Stop order and patience: the gateway first (no new requests), then the workers (they drain).
GATEWAY_STOP = ((signal.SIGTERM, 15.0),)
WORKER_STOP = ((signal.SIGTERM, 40.0),)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        default=None,
        help="config file (default: $SYSHAX_CONFIG or ~/.config/syshax/config.yaml; built-in defaults if absent)",
    )
    p.add_argument(
        "--engine",
        choices=("model", "echo", "emulated", "vllm"),
        default=None,
        help="model = the real engine in every worker; echo = zero-cost stand-in engine in every "
        "worker, to measure the farm's own overhead; emulated = an emulated accelerator as the "
        "xPU worker (gpu.profile's step times, meaningless text) beside real CPU decode workers; "
        "vllm = vLLM as the xPU worker's engine (gpu.vllm settings; every worker runs with this "
        "Python, so run syshax from the venv that has vLLM, e.g. .venv-vllm/bin/syshax run; "
        "docs/vllm.md) (default: gpu.engine for the xPU worker, native = model; model for the "
        "CPU workers)",
    )
    p.add_argument(
        "--cpu-workers",
        type=int,
        default=None,
        help="CPU decode workers (default: cpu.workers from the config; when that is null, "
        "1 with an accelerator, 0 without: one worker with both roles on every core)",
    )
    p.add_argument("--no-gateway", action="store_true", help="start only Redis and the workers")


def has_accelerator(device: str) -> bool:
    """Will the xPU worker find a CUDA device? Decided without importing torch (the supervisor
    stays small): the setting, else whether the NVIDIA driver lists a GPU."""
    if device == "cpu":
        return False
    if device.startswith("cuda"):
        return True
    gpus = "/proc/driver/nvidia/gpus"
    return os.path.isdir(gpus) and bool(os.listdir(gpus))


def engines(cfg, engine: str | None) -> tuple[str, str]:
    """(the xPU worker's engine, the CPU workers' engine) for `--engine` (None = the config)."""
    if engine in ("model", "echo"):
        return engine, engine
    if engine is None:
        engine = "model" if cfg.gpu.engine == "native" else cfg.gpu.engine
    return engine, "model"


def layout(cfg, cpu_workers: int | None, xpu_engine: str | None = None) -> tuple[int, int | None]:
    """(CPU decode workers, threads for the xPU worker or None for its own default).
    `xpu_engine` None = the config's; an emulated accelerator counts as an accelerator; vLLM
    keeps its own threads."""
    xpu_engine = xpu_engine or engines(cfg, None)[0]
    emulated = xpu_engine == "emulated"
    accel = emulated or has_accelerator(cfg.gpu.device)
    n_cpu = cpu_workers if cpu_workers is not None else cfg.cpu.workers
    if n_cpu is None:
        n_cpu = 1 if accel else 0
    threads = None
    if not accel and n_cpu == 0 and cfg.gpu.threads is None and xpu_engine != "vllm":
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        threads = threads or os.cpu_count() or 1
    return n_cpu, threads


def _children(args, cfg, config_path: str | None, url: str) -> list[Child]:
    base = [sys.executable, "-m", "syshax.cli"]
    common = ["--redis-url", url] + (["--config", config_path] if config_path else [])
    xpu_engine, cpu_engine = engines(cfg, args.engine)
    n_cpu, xpu_threads = layout(cfg, args.cpu_workers, xpu_engine)
    emulated = {"emulated": f", EMULATED {cfg.gpu.profile}", "vllm": ", vLLM"}.get(xpu_engine, "")
    log.warning(
        "layout: xPU-role worker (prefill + decode%s%s) + %d CPU decode worker(s)",
        f", {xpu_threads} threads" if xpu_threads else "",
        emulated,
        n_cpu,
    )
    workers = [
        _worker(
            "xpu-worker",
            base
            + [
                "worker",
                "--roles",
                "prefill,decode",
                "--device-class",
                "gpu",
                "--engine",
                xpu_engine,
            ]
            + (["--threads", str(xpu_threads)] if xpu_threads else [])
            + common,
        ),
    ]
    for i in range(n_cpu):
        workers.append(
            _worker(
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
                    cpu_engine,
                    "--port",  # CPU worker i serves /metrics on cpu.port + i
                    str(cfg.cpu.port + i),
                ]
                + common,
            )
        )
    # Offline batches (rq jobs on the batch queue) enter the farm through its batch stream.
    workers.append(_worker("batch-worker", base + ["batch", "worker"] + common))
    gateway = [Child("gateway", base + ["gateway"] + common, stop_steps=GATEWAY_STOP)]
    return ([] if args.no_gateway else gateway) + workers


def _worker(name: str, argv: list[str]) -> Child:
    return Child(name, argv, stage=1, stop_steps=WORKER_STOP)


def run(args: argparse.Namespace) -> int:
    from syshax.broker.embedded import EmbeddedRedis, EmbeddedRedisError
    from syshax.shared.config import ConfigError, load_config, redact_url

    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        print(f"syshax run: {exc}", file=sys.stderr)
        return 2
    from syshax.shared.logs import apply_log_level

    apply_log_level(cfg.log_level)
    if engines(cfg, args.engine)[0] == "emulated":
        # Checked here, once: a worker that cannot load it would only be restarted in a loop.
        from syshax.workers.accelerator_profiles import ProfileError, load_profile

        try:
            load_profile(cfg.gpu.profile)
        except ProfileError as exc:
            print(f"syshax run: gpu.profile: {exc}", file=sys.stderr)
            return 2
    if engines(cfg, args.engine)[0] == "vllm":  # the same: vLLM here, settings, an HF folder
        from syshax.commands.vllm_setup import vllm_problems

        problems = vllm_problems(cfg)
        if problems:
            print("\n".join(f"syshax run: {p}" for p in problems), file=sys.stderr)
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
    supervisor = Supervisor(children, env=dict(os.environ), logger=log, start_level=logging.WARNING)
    print(
        f"sysHAX farm: gateway on http://{cfg.conductor.host}:{cfg.conductor.port}/v1 "
        f"(model loading takes a few seconds; Ctrl-C stops everything)",
        flush=True,
    )
    try:
        supervisor.start()
        supervisor.run(stop)
    finally:
        supervisor.stop()
        farm_file.remove(published)
        if embedded is not None:
            embedded.stop()
    return 0
