"""`syshax run`: the whole farm on this host, each part its own process.

Starts an embedded Redis when no `redis.url` is configured, then the gateway, the xPU worker
(prefill + decode; on the CPU when there is no CUDA device) and `cpu.workers` CPU decode
workers, each as `syshax worker ...` / `syshax gateway ...` so one crash does not take the
others down.

The one-host layout (workers/farm_layout.py `farm_layout`, the rule a bare `syshax worker`
follows too): with an accelerator, the xPU worker prefills on it and one CPU
decode worker takes the decodes the dispatcher sends to the CPU. With none, a second worker
would only split the same cores into two halves that each read all the weights (measured in
docs/benchmarks.md: the split served less than one worker), so the default is one worker with
both roles on every core; `cpu.workers` / `--cpu-workers` still ask for the split (the PD
pipeline stays testable on any host). An emulated accelerator (`xpu.engine: emulated` or
`--engine emulated`: the xPU worker sleeps for a profile's step times and runs no model) counts
as an accelerator: by default one real CPU decode worker beside it, so a GPU host's dispatch
runs on a host without one. With `xpu.engine: vllm` (`--engine vllm`) vLLM is the xPU worker's
engine: every worker runs with this Python (`sys.executable`), so run `syshax run` from the
venv that has vLLM (docs/vllm.md); the layout is the native engine's (an accelerator when
`xpu.device` finds one). A child that exits unexpectedly is restarted with a capped backoff;
a worker comes back under the same worker id (`run_worker_id`), so it takes back the jobs it
held at once instead of leaving them to a claim after its heartbeat's TTL.
On Ctrl-C or SIGTERM it stops in uvicorn's order: the gateway first (it refuses new requests
and lets streams in flight finish, up to `shutdown_grace` seconds), then the workers (they
drain), then Redis; a second Ctrl-C stops everything at once. The children run in sessions of
their own, so a terminal's Ctrl-C reaches only this supervisor, which stops them in that order.

With no `redis.url`, the embedded Redis is one of the supervised children (`broker/farm_redis`:
a unix socket in the farm's 0700 directory, a generated password, an ACL user without admin
commands, an AOF): restarted on the same socket if it dies, stopped last. The farm's Redis URL
reaches the children in $SYSHAX_REDIS_URL, never on a command line.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import secrets
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from syshax.broker.connect import sync_client
from syshax.broker.farm_redis import FarmRedis
from syshax.broker.keys import Keys
from syshax.commands.renamed import with_old_names
from syshax.commands.supervisor import Child, Supervisor
from syshax.shared.env import spin_for_shared_cores
from syshax.workers.checks import xpu_engine_problems
from syshax.workers.farm_layout import every_core, farm_engines, farm_layout
from syshax.workers.model_split import split_threads, weights_bytes
from syshax.workers.settings import ENGINE_ALIASES, ENGINES

log = logging.getLogger("syshax.run")

# Stop order: the gateway first (no new requests; streams finish), then the workers (they
# drain), Redis last (everything above still needs it until it exits).
GATEWAY_STAGE, WORKERS_STAGE, REDIS_STAGE = 0, 1, 2
WORKER_STOP = ((signal.SIGTERM, 40.0),)
REDIS_STOP = ((signal.SIGTERM, 10.0),)  # it writes the AOF's last second and exits
# One per `syshax run`: its workers' ids, the same across a worker's restarts, differ from
# those of any other farm process (another run on this host, or one in another container
# whose host name and pid happen to match).
RUN_TOKEN = secrets.token_hex(2)
# A signal this soon after the first is the same stop reaching us twice (a wrapper such as
# timeout(1) or make forwarding the terminal's SIGINT that we also got), not a second Ctrl-C.
SECOND_SIGNAL_AFTER = 0.5


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        default=None,
        help="config file (default: $SYSHAX_CONFIG or ~/.config/syshax/config.yaml; built-in defaults if absent)",
    )
    p.add_argument(
        "--engine",
        choices=ENGINES,
        type=with_old_names("--engine", ENGINE_ALIASES),
        default=None,
        help="native = our own engine (the model) in every worker (`model`, its old name, is "
        "accepted); echo = zero-cost stand-in engine in every "
        "worker, to measure the farm's own overhead; emulated = an emulated accelerator as the "
        "xPU worker (xpu.profile's step times, meaningless text) beside real CPU decode workers; "
        "vllm = vLLM as the xPU worker's engine (xpu.vllm settings; every worker runs with this "
        "Python, so run syshax from the venv that has vLLM, e.g. .venv-vllm/bin/syshax run; "
        "docs/vllm.md) (default: xpu.engine for the xPU worker, native for "
        "the CPU workers)",
    )
    p.add_argument(
        "--cpu-workers",
        type=int,
        default=None,
        help="CPU decode workers (default: cpu.workers from the config; when that is null, "
        "1 with an accelerator, 0 without: one worker with both roles on every core)",
    )
    p.add_argument("--no-gateway", action="store_true", help="start only Redis and the workers")


def engines(cfg, engine: str | None) -> tuple[str, str]:
    """(the xPU worker's engine, the CPU workers' engine) for `--engine` (None = the config);
    workers/farm_layout.py decides (bench/serve.py lays out its farms through this name)."""
    return farm_engines(cfg, engine)


def layout(cfg, cpu_workers: int | None, xpu_engine: str | None = None) -> tuple[int, int | None]:
    """(CPU decode workers, --threads for the xPU worker or None for its own default), as
    workers/farm_layout.py's `farm_layout` decides; `xpu_engine` None = the config's."""
    plan = farm_layout(cfg, xpu_engine, cpu_workers)
    return plan.cpu_workers, plan.xpu_threads


def _children(args, cfg, config_path: str | None) -> list[Child]:
    """The farm's processes but Redis. None gets the Redis URL on its command line (every local
    user can read /proc/PID/cmdline): they read $SYSHAX_REDIS_URL from the environment."""
    base = [sys.executable, "-m", "syshax.cli"]
    common = ["--config", config_path] if config_path else []
    if cfg.models:
        return _clients(args, cfg, base, common, _model_workers(args, cfg, base, common))
    plan = farm_layout(cfg, args.engine, args.cpu_workers)
    xpu_engine, cpu_engine = plan.xpu_engine, plan.cpu_engine
    n_cpu, xpu_threads = plan.cpu_workers, plan.xpu_threads
    emulated = {"emulated": f", EMULATED {cfg.xpu.profile}", "vllm": ", vLLM"}.get(xpu_engine, "")
    log.info(
        "layout: xPU-role worker (prefill + decode%s%s) + %d CPU decode worker(s)",
        f", {xpu_threads} threads" if xpu_threads else "",
        emulated,
        n_cpu,
    )
    xpu = ["worker", "--roles", "prefill,decode", "--device-class", "xpu", "--engine", xpu_engine]
    workers = [
        _worker(
            "xpu-worker",
            base + xpu + (["--threads", str(xpu_threads)] if xpu_threads else []) + common,
        )
    ]
    for i in range(n_cpu):
        cpu = ["worker", "--roles", "decode", "--device", "cpu", "--device-class", "cpu"]
        cpu += ["--engine", cpu_engine, "--port", str(cfg.cpu.port + i)]  # /metrics: port + i
        workers.append(_worker(f"cpu-worker-{i}", base + cpu + common))
    return _clients(args, cfg, base, common, workers)


def _model_workers(args, cfg, base: list[str], common: list[str]) -> list[Child]:
    """A farm of several models (config `models:`): per model, an xPU-role worker (both roles)
    and the CPU decode workers its own layout asks for (`farm_layout`: its cpu.workers or
    --cpu-workers, else one beside an accelerator), all on its job streams (`--serve`). The
    host's cores are split between the models in proportion to their weights' size, at least
    one thread each (workers/model_split.py); a model with CPU decode workers gives half of its
    threads to its xPU worker and shares the rest between them. Model 0 keeps xpu.port and
    cpu.port for /metrics; the others' workers get their entry's own ports, else none (two
    workers cannot share a port)."""
    models = cfg.served_models()
    sizes = [weights_bytes(_model_path(m.config)) for m in models]
    threads = split_threads(sizes, every_core())
    workers = []
    for i, (m, n) in enumerate(zip(models, threads, strict=True)):
        plan = farm_layout(m.config, args.engine, args.cpu_workers)
        n_cpu = plan.cpu_workers
        xpu_threads = max(1, n // 2) if n_cpu else n
        cpu_threads = max(1, (n - xpu_threads) // n_cpu) if n_cpu else 0
        log.info(
            "layout: model %s (%.0f MiB of weights, %d threads): an xPU-role worker (%s engine, %d threads) + %d CPU decode worker(s)",
            m.key, sizes[i] / 2**20, n, plan.xpu_engine, xpu_threads, n_cpu,
        )  # fmt: skip
        xpu_port = m.config.xpu.port if i == 0 or m.config.xpu.port != cfg.xpu.port else 0
        argv = ["worker", "--roles", "prefill,decode", "--device-class", "xpu"]
        argv += ["--engine", plan.xpu_engine, "--serve", m.key]
        argv += ["--threads", str(xpu_threads), "--port", str(xpu_port)]
        workers.append(_worker(f"worker-{m.key}", base + argv + common))
        cpu_port = m.config.cpu.port if i == 0 or m.config.cpu.port != cfg.cpu.port else 0
        for j in range(n_cpu):
            cpu = ["worker", "--roles", "decode", "--device", "cpu", "--device-class", "cpu"]
            cpu += ["--engine", plan.cpu_engine, "--serve", m.key, "--threads", str(cpu_threads)]
            cpu += ["--port", str(cpu_port + j if cpu_port else 0)]
            workers.append(_worker(f"cpu-worker-{m.key}-{j}", base + cpu + common))
    return workers


def _model_path(cfg) -> Path:
    try:
        return cfg.model_path()
    except FileNotFoundError:  # the missing default model: its worker says so
        return Path()


def _clients(args, cfg, base: list[str], common: list[str], workers: list[Child]) -> list[Child]:
    """The gateway and the batch worker around the workers."""
    # Offline batches (rq jobs on the batch queue) enter the farm through its batch stream. Like
    # the gateway it is a client of the workers: it stops first, while they can still finish
    # its running requests (a request it cannot finish in time is requeued, not lost).
    batch_argv = base + ["batch", "worker"] + common
    batch = Child("batch-worker", batch_argv, stage=GATEWAY_STAGE, stop_steps=WORKER_STOP)
    # The gateway lets streams in flight finish for shutdown_grace s; a margin, then SIGKILL.
    stop = ((signal.SIGTERM, cfg.shutdown_grace + 10.0),)
    gateway = [Child("gateway", base + ["gateway"] + common, stage=GATEWAY_STAGE, stop_steps=stop)]
    return ([] if args.no_gateway else gateway) + workers + [batch]


def _farm_env(children: list[Child], url: str) -> dict[str, str]:
    """The children's environment: the Redis URL (never on a command line), and the short
    OpenMP spin where several workers share the cores (shared/env.py)."""
    env = dict(os.environ, SYSHAX_REDIS_URL=url)
    return spin_for_shared_cores(env) if _compute_processes(children) > 1 else env


def _compute_processes(children: list[Child]) -> int:
    """The farm's worker processes (each computes on this host's cores: an emulated xPU
    worker runs the model on the CPU too)."""
    return sum(1 for c in children if _subcommand(c) == "worker")


def _subcommand(child: Child) -> str | None:
    """The `syshax` command a child runs (`python -m syshax.cli COMMAND ...`), else None."""
    argv = child.argv or []
    at = argv.index("syshax.cli") + 1 if "syshax.cli" in argv else len(argv)
    return argv[at] if at < len(argv) else None


def run_worker_id(name: str) -> str:
    """The worker id of child `name` of this `syshax run`. A restarted worker keeps it: its
    jobs stay pending under the id, and a worker that starts under an id takes back what is
    pending under it (workers/upkeep.py `take_back_own`), so the streams it held resume as
    soon as it has loaded its model (its first restart is at once: `restart_at_once`).
    A new id would leave them to another live worker's claim once the dead one's heartbeat
    expired (its TTL, 10 s by default) and, in the one-worker layout, to the restarted worker
    after that TTL."""
    return f"{name}-{socket.gethostname()}-{os.getpid()}-{RUN_TOKEN}"


def _worker(name: str, argv: list[str]) -> Child:
    argv = [*argv, "--id", run_worker_id(name)]
    return Child(name, argv, stage=WORKERS_STAGE, stop_steps=WORKER_STOP, restart_at_once=True)


def _embedded_redis(cfg, home) -> tuple[Child, FarmRedis]:
    """The embedded server as the supervisor's last child: stopped after everything that uses
    it, restarted (quickly) if it dies."""
    server = FarmRedis(
        home, maxmemory_mib=cfg.redis.maxmemory_mib, tcp_port=cfg.redis.embedded_port
    )
    server.write_conf()
    child = Child("redis", server.argv(), stage=REDIS_STAGE, stop_steps=REDIS_STOP, max_backoff=2.0)
    return child, server


def run(args: argparse.Namespace) -> int:
    from syshax.broker.embedded import EmbeddedRedisError
    from syshax.shared.config import ConfigError, load_config, resolve_config_path
    from syshax.shared.logs import apply_log_level

    try:
        cfg = load_config(args.config)
        apply_log_level(cfg.log_level)
        # What keeps the xPU worker's engine from starting, said before anything starts: a
        # worker that cannot load it would only be restarted in a loop.
        problems = [  # each model's, in a farm of several
            p
            for m in cfg.served_models()
            for p in xpu_engine_problems(m.config, farm_engines(m.config, args.engine)[0])
        ]
        if not problems:
            config_path = resolve_config_path(args.config)
            redis_child, server, url = _redis(cfg, config_path)
    except (ConfigError, EmbeddedRedisError, OSError) as exc:
        problems = [str(exc)]
    if problems:
        print("\n".join(f"syshax run: {p}" for p in problems), file=sys.stderr)
        return 2
    children = _children(args, cfg, args.config)
    env = _farm_env(children, url)
    supervisor = Supervisor(([redis_child] if redis_child else []) + children, env=env, logger=log)
    stop = _stop_on_signals(supervisor, cfg.shutdown_grace)
    try:
        if redis_child is not None:
            supervisor.start([redis_child])
            server.wait_ready(alive=lambda: redis_child.exitcode() is None)
            log.info("embedded Redis on %s (password in %s, 0600)", server.socket, server.conf_path)
        with _published(cfg, config_path, url):
            try:
                supervisor.start(children)
                supervisor.run(stop)
            finally:
                supervisor.stop()  # before the segments are swept
    except EmbeddedRedisError as exc:
        print(f"syshax run: {exc}", file=sys.stderr)
        return 2
    finally:
        supervisor.stop()  # Redis, when it never came up (a no-op after an orderly stop)
    log.info("stopped")
    return 0


def _redis(cfg, config_path) -> tuple[Child | None, FarmRedis | None, str]:
    """(the embedded Redis's child, its server, the URL) with no redis.url; else (None, None,
    redis.url), with a warning when that Redis answers anyone."""
    from syshax.broker.security import open_redis_warning
    from syshax.shared import farm_file
    from syshax.shared.config import redact_url

    if not cfg.redis.url:
        child, server = _embedded_redis(
            cfg, farm_file.farm_dir(config_path, cfg.redis.prefix, create=True)
        )
        return child, server, server.url
    log.info("using Redis at %s", redact_url(cfg.redis.url))
    warning = open_redis_warning(cfg.redis.url)
    if warning:
        log.warning("%s", warning)
    return None, None, cfg.redis.url


def _stop_on_signals(supervisor: Supervisor, grace: int) -> threading.Event:
    """SIGINT/SIGTERM set the returned event (an orderly stop); a second one, more than
    SECOND_SIGNAL_AFTER later, kills every child at once."""
    stop = threading.Event()
    first = [0.0]

    def on_signal(*_) -> None:
        now = time.monotonic()
        if not stop.is_set():
            first[0] = now
            log.info(
                "stopping: streams in flight get up to %ds to finish (Ctrl-C again stops now)",
                grace,
            )
            stop.set()
        elif now - first[0] > SECOND_SIGNAL_AFTER:
            log.warning("stopping now")
            supervisor.kill(wait=False)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    return stop


@contextlib.contextmanager
def _published(cfg, config_path, url: str):
    """While the farm runs: its runtime file published, and its shared-memory KV segments swept
    before (an earlier run killed with SIGKILL) and after (a worker killed on the way)."""
    from syshax.broker.kv_store import KVStore, sweep_segments
    from syshax.shared import farm_file

    farm_tag = KVStore(sync_client(url), Keys(cfg.redis.prefix)).farm
    swept = sweep_segments(farm_tag)
    if swept:
        log.info("freed %d shared-memory KV segment(s) left by an earlier run", swept)
    gateway_url = f"http://{cfg.gateway.host}:{cfg.gateway.port}/v1"
    published = farm_file.publish(config_path, cfg.redis.prefix, url, gateway_url)
    print(
        f"sysHAX farm: gateway on {gateway_url} (model loading takes a few seconds; "
        "Ctrl-C stops everything, letting streams finish)",
        flush=True,
    )
    try:
        yield
    finally:
        farm_file.remove(published)
        sweep_segments(farm_tag)
