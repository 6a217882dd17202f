"""`syshax worker`: one worker process (one engine on one device, roles prefill and/or decode).

Engines: `model` (the real one, on --device), `echo` (a zero-cost stand-in), `emulated` (an
emulated accelerator for the xPU role: steps sleep for a profile's predicted time) and `vllm`
(vLLM as the xPU, docs/vllm.md). Without --engine the xPU class follows `gpu.engine` (native =
model) and the CPU class runs the model. A worker that prefills decides where each decode
goes with the config's `decode_device`, `auto_pd_offload` and `slo.itl_ms`."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import threading
import time
import uuid

log = logging.getLogger("syshax.worker")
MAX_BACKOFF = 10.0  # seconds between reconnection attempts while Redis is down, at most
STABLE_S = 30.0  # connected this long: the backoff starts again from its shortest wait
ENGINES = ("model", "echo", "emulated", "vllm")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        default=None,
        help="config file (default: $SYSHAX_CONFIG or ~/.config/syshax/config.yaml)",
    )
    p.add_argument(
        "--roles",
        default="prefill,decode",
        help="comma list of prefill, decode (default: %(default)s)",
    )
    p.add_argument(
        "--device",
        default=None,
        help="cpu, cuda, cuda:N or auto (default: gpu.device for the xPU class, cpu for the cpu class)",
    )
    p.add_argument(
        "--device-class",
        choices=("gpu", "cpu"),
        default=None,
        help="which decode stream this worker serves: gpu = the xPU role (even when it runs on a CPU), "
        "cpu = CPU decode (default: cpu for a decode-only worker of the model engine on the CPU, "
        "else gpu)",
    )
    p.add_argument("--id", default=None, help="worker id (default: <class>-<host>-<pid>)")
    p.add_argument(
        "--host",
        default=None,
        help="address of this worker's /metrics and /health (default: gpu.host or cpu.host)",
    )
    p.add_argument(
        "--port",
        type=int,
        default=None,
        help="port of this worker's /metrics and /health; 0 = none (default: gpu.port or cpu.port)",
    )
    p.add_argument(
        "--redis-url", default=None, help="Redis URL (default: redis.url from the config)"
    )
    p.add_argument(
        "--model", default=None, help="model path or 'default' (default: model from the config)"
    )
    p.add_argument(
        "--dtype", default=None, help="float32, bfloat16, float16 (default: dtype from the config)"
    )
    p.add_argument(
        "--max-model-len", type=int, default=None, help="context length (default: from the config)"
    )
    p.add_argument(
        "--max-batch-size",
        type=int,
        default=None,
        help="sequences at once (default: gpu.max_batch_size or cpu_max_batch_size)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads on a CPU device (default: from the config, else half the cores)",
    )
    p.add_argument(
        "--engine",
        choices=ENGINES,
        default=None,
        help="model = the real engine on --device; echo = zero-cost stand-in for overhead "
        "benchmarks; emulated = an emulated accelerator for the xPU class (no model runs: each "
        "step sleeps for the time --profile predicts, the text is meaningless, handed-off KV has "
        "the real model's shape; docs/emulated-accelerator.md); vllm = vLLM serves the xPU class "
        "(gpu.vllm settings; needs vLLM in the Python running this, e.g. .venv-vllm/bin/syshax, "
        "and an HF model folder: `syshax convert` makes one; docs/vllm.md) (default: gpu.engine "
        "for the xPU class, native = model; model for the cpu class)",
    )
    p.add_argument(
        "--profile",
        default=None,
        metavar="NAME|PATH",
        help="emulated engine only: accelerator profile, a built-in name (h100, a100-40gb, a10) "
        "or a YAML/JSON profile file (default: gpu.profile)",
    )
    p.add_argument(
        "--step-delay",
        type=float,
        default=0.0,
        help="echo engine only: seconds per engine step, so a generation lasts long enough to "
        "kill a worker mid-stream in reliability tests (default: %(default)s)",
    )
    p.add_argument(
        "--heartbeat-ttl",
        type=float,
        default=None,
        help="seconds without a heartbeat after which this worker counts as dead and its jobs "
        "are claimed by others; heartbeats are sent every second, so at least 2 "
        "(default: 10)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds to finish running requests on SIGTERM (default: %(default)s)",
    )


def _resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _engine_and_class(args, cfg, roles: frozenset[str]) -> tuple[str, str]:
    """(engine, device class): an emulated or vLLM accelerator is the xPU class; else the class
    is cpu for a decode-only worker on the CPU, else gpu; without --engine the xPU class
    follows gpu.engine (native = model) and the CPU class runs the model."""
    engine = args.engine
    if args.device_class:
        cls = args.device_class
    elif engine in ("emulated", "vllm"):
        cls = "gpu"
    else:
        cls = "cpu" if roles == {"decode"} and (args.device or "cpu") == "cpu" else "gpu"
    if engine is None:
        engine = cfg.gpu.engine if cls == "gpu" and cfg.gpu.engine != "native" else "model"
    return engine, cls


def _emulated_profile(args, cfg, cls: str):
    """The accelerator profile of an emulated-engine worker (None for the other engines);
    raises ValueError with the reason the options do not fit."""
    if args.engine != "emulated":
        if args.profile:
            raise ValueError("--profile is for the emulated engine only (--engine emulated)")
        return None
    if cls != "gpu":
        raise ValueError("the emulated engine is an accelerator: it serves the xPU class (gpu)")
    if args.device:
        raise ValueError("--device does not apply to the emulated engine (it runs no model)")
    from syshax.workers.accelerator_profiles import ProfileError, load_profile

    try:
        return load_profile(args.profile or cfg.gpu.profile)
    except ProfileError as exc:
        where = "--profile" if args.profile else "gpu.profile"
        raise ValueError(f"{where}: {exc}") from None


def _prompt_rows_while_decoding(cfg, device: str) -> int | None:
    """The config's value; null = a cap on a CPU engine (whose prompt rows cost a running
    stream ~5 ms each at 1B on 2 cores), none on an accelerator (where they cost microseconds
    and a smaller chunk only slows the prefill)."""
    from syshax.shared.config_schema import DEFAULT_CPU_PROMPT_ROWS_WHILE_DECODING

    if cfg.prompt_rows_while_decoding is not None:
        return cfg.prompt_rows_while_decoding
    return DEFAULT_CPU_PROMPT_ROWS_WHILE_DECODING if device == "cpu" else None


def _below_the_farm(cpu) -> None:
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
    if cpu.sched_idle and hasattr(os, "SCHED_IDLE"):
        try:
            for tid in threads:
                with contextlib.suppress(ProcessLookupError):  # a thread that just ended
                    os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            return
        except OSError as exc:
            log.warning("SCHED_IDLE refused (%s); running at nice %d instead", exc, cpu.nice)
    if cpu.nice:
        for tid in threads:
            with contextlib.suppress(ProcessLookupError):
                os.setpriority(
                    os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + cpu.nice
                )


def _handoff_slots(args, cfg, cls: str, device: str, roles: frozenset[str]) -> int:
    """One engine slot beyond the decode slots for an accelerator that prefills and decodes
    in a farm that may offload decode: a prompt is prefilled there for the CPU while every
    decode slot is busy (WorkerOptions.handoff_slots). Not for the xPU role on a CPU (the
    farm without an accelerator has no CPU decoders to offload to)."""
    accelerator = args.engine in ("emulated", "vllm") or device != "cpu"
    offloads = cfg.auto_pd_offload and cfg.decode_device == "auto"
    return int(cls == "gpu" and accelerator and offloads and {"prefill", "decode"} <= roles)


def _served_model(args, cfg) -> str:
    """The model name this worker serves: its jobs must name it, and its KV blobs carry it."""
    from syshax.shared.config import derive_model_name

    return cfg.served_model_name or derive_model_name(args.model or cfg.model)


def _build_engine(args, cfg, device: str, slots: int, kernels=None, profile=None):
    from syshax.shared.tokenizer import Tokenizer
    from syshax.workers.engine.loader import resolve_model_path

    model = args.model or cfg.model
    served = _served_model(args, cfg)  # every engine's KV identity: weights digest + this
    if args.engine == "vllm":  # vLLM is imported in this branch only
        from syshax.commands.vllm_setup import build_engine

        return build_engine(args, cfg, resolve_model_path(model), slots, served)
    if args.engine == "emulated":
        from syshax.workers.emulated_engine import EmulatedEngine

        tok = Tokenizer.from_model_path(resolve_model_path(model))
        return EmulatedEngine(
            model,
            profile,
            tok,
            max_model_len=args.max_model_len or cfg.max_model_len,
            max_num_seqs=slots,
            max_num_batched_tokens=max(cfg.max_num_batched_tokens, slots),
            prefix_caching=cfg.kv.prefix_caching,
            served_model=served,
        )
    if args.engine == "echo":
        from syshax.workers.echo_engine import EchoEngine

        tok = Tokenizer.from_model_path(resolve_model_path(model))
        return EchoEngine(
            tok,
            max_model_len=args.max_model_len or cfg.max_model_len,
            max_num_seqs=slots,
            max_num_batched_tokens=max(cfg.max_num_batched_tokens, slots),
            step_delay=args.step_delay,
            served_model=served,
        )
    from syshax.workers.engine.engine import Engine

    return Engine(
        model,
        device=device,
        dtype=args.dtype or cfg.dtype,
        max_model_len=args.max_model_len or cfg.max_model_len,
        max_num_seqs=slots,
        max_num_batched_tokens=max(cfg.max_num_batched_tokens, slots),
        kv_cache_bytes=cfg.kv.cache_mib * 2**20 if cfg.kv.cache_mib else None,
        prefix_caching=cfg.kv.prefix_caching,
        prompt_rows_while_decoding=_prompt_rows_while_decoding(cfg, device),
        served_model=served,
        **(kernels.engine_kwargs() if kernels is not None else {}),
    )


def _cpu_kernel_options(cls: str, device: str, threads: int, engine: str, model):
    """The native kernels' options for a model worker on a CPU device, checked before loading
    and resolved by the default rule (workers/cpu/options.py: a GGUF runs its own blocks with
    the fused step); None for GPU and echo workers. CUSTOM_CPU_AFFINITY pins CPU-class
    workers only (an xPU-role worker on a CPU-only host shares the cores unpinned)."""
    if device != "cpu" or engine != "model":
        return None
    from syshax.workers.cpu.options import from_env

    opts = from_env(threads)
    if cls != "cpu":
        opts = dataclasses.replace(opts, cpus=None)
    return opts.resolved(model, device)


def run(args: argparse.Namespace) -> int:
    import redis

    from syshax.broker.dispatcher import Dispatcher
    from syshax.broker.keys import Keys
    from syshax.shared.config import ConfigError, load_config, resolve_threads
    from syshax.workers.metrics import WorkerMetrics, serve_metrics
    from syshax.workers.worker import Worker, WorkerOptions

    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    from syshax.shared.logs import apply_log_level

    apply_log_level(cfg.log_level)
    roles = frozenset(r.strip() for r in args.roles.split(",") if r.strip())
    if not roles or not roles <= {"prefill", "decode"}:
        log.error("--roles must be a comma list of prefill, decode; got %r", args.roles)
        return 2
    args.engine, cls = _engine_and_class(args, cfg, roles)
    try:
        profile = _emulated_profile(args, cfg, cls)
        if args.engine == "vllm":  # before anything heavy: vLLM importable, the settings
            from syshax.commands.vllm_setup import check_worker

            check_worker(args, cfg, cls)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    if args.engine == "vllm":
        device = f"vllm:{_resolve_device('auto')}"  # vLLM picks its device
    elif profile is not None:
        device = f"emulated:{profile.name}"  # what the heartbeat and the token events show
    else:
        device = _resolve_device(args.device or (cfg.gpu.device if cls == "gpu" else "cpu"))
    from syshax.shared import env
    from syshax.shared.env import EnvError
    from syshax.workers.cpu.affinity import AffinityError
    from syshax.workers.engine.errors import EngineError

    try:
        threads = (
            args.threads
            or (env.omp_num_threads() if cls == "cpu" else None)
            or resolve_threads(cfg.gpu.threads if cls == "gpu" else cfg.cpu.threads)
        )
        kernels = _cpu_kernel_options(cls, device, threads, args.engine, args.model or cfg.model)
    except (EnvError, AffinityError, EngineError) as exc:
        log.error("%s", exc)
        return 2
    if cls == "cpu":
        _below_the_farm(cfg.cpu)
    if device == "cpu" and args.engine == "model":
        import torch

        torch.set_num_threads(threads)
    if kernels is not None:
        from syshax.workers.cpu.options import pin_threads

        try:
            pin_threads(kernels)
        except Exception as exc:  # a kernel build failure or a refused pinning: say which
            log.error("%s", exc)
            return 2
    slots = args.max_batch_size or (
        cfg.gpu.max_batch_size if cls == "gpu" else cfg.cpu_max_batch_size
    )
    if args.step_delay and args.engine != "echo":
        log.error("--step-delay is for the echo engine only (--engine echo)")
        return 2
    if args.step_delay < 0:
        log.error("--step-delay must be >= 0, got %s", args.step_delay)
        return 2
    if args.heartbeat_ttl is not None and args.heartbeat_ttl < 2:
        log.error("--heartbeat-ttl must be at least 2 seconds, got %s", args.heartbeat_ttl)
        return 2
    from syshax.shared import farm_file
    from syshax.shared.config import resolve_config_path

    url = farm_file.redis_url(args.redis_url, cfg, resolve_config_path(args.config), "worker")
    if not url:
        log.error("%s", farm_file.NO_FARM)
        return 2
    handoff_slots = _handoff_slots(args, cfg, cls, device, roles)
    try:
        engine = _build_engine(args, cfg, device, slots + handoff_slots, kernels, profile)
    except EngineError as exc:
        log.error("%s", exc)
        return 2
    if args.engine == "model":
        from syshax.workers.engine.engine import freeze_loaded_heap

        freeze_loaded_heap()  # the engine lives as long as this process
    worker_id = args.id or f"{cls}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"
    opts = WorkerOptions(
        worker_id=worker_id,
        roles=roles,
        device_class=cls,
        device=device,
        served_model=_served_model(args, cfg),
        kv_store=cfg.kv.store,
        kv_ttl=cfg.kv.ttl,
        output_ttl=cfg.output.ttl,
        handoff_slots=handoff_slots,
    )
    if args.heartbeat_ttl is not None:
        opts.heartbeat_ttl = args.heartbeat_ttl
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    dispatcher = Dispatcher(
        auto_pd_offload=cfg.auto_pd_offload,
        cpu_max_batch_size=cfg.cpu_max_batch_size,
        decode_device=cfg.decode_device,
        slo_itl_s=cfg.slo_itl_s,
    )
    metrics = WorkerMetrics(worker_id, cls)
    section = cfg.gpu if cls == "gpu" else cfg.cpu
    port = section.port if args.port is None else args.port
    if port:
        serve_metrics(metrics, args.host or section.host, port)
    r = redis.Redis.from_url(url, health_check_interval=10)
    backoff, connected_at = 0.5, 0.0
    worker = None
    while not stop.is_set():
        try:
            if worker is not None:
                worker.cancels.close()  # the lost connection's pub/sub
            worker = None
            worker = Worker(engine, r, opts, dispatcher, Keys(cfg.redis.prefix), metrics)
            connected_at = time.monotonic()
            log.info(
                "worker %s ready: roles=%s device=%s class=%s slots=%s%s",
                worker_id,
                ",".join(sorted(roles)),
                device,
                cls,
                f"{slots} (+{handoff_slots} to prefill for the CPU)" if handoff_slots else slots,
                _dispatch_note(cfg) if "prefill" in roles else "",
            )
            worker.serve(stop, drain_timeout=args.drain_timeout)
            return 0
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            # Redis restarting: keep the engine (loading it is the slow part), retry with a
            # capped exponential backoff, never crash-loop.
            if connected_at and time.monotonic() - connected_at > STABLE_S:
                backoff = 0.5  # it had been up a while: a new outage starts with short waits
            connected_at = 0.0
            log.warning("Redis unreachable (%s); retrying in %.1fs", exc, backoff)
            _abort_all(engine)
            stop.wait(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF)
            continue
    return 0


def _dispatch_note(cfg) -> str:
    """How this prefill worker dispatches decodes, for its ready line."""
    device = "xpu" if not cfg.auto_pd_offload else cfg.decode_device
    slo = f", slo.itl_ms={cfg.slo.itl_ms:g}" if cfg.slo.itl_ms is not None else ""
    return f"; decodes: decode_device={device}{slo}"


def _abort_all(engine) -> None:
    """After losing Redis the jobs' entries stay pending: they will be reclaimed, so drop ours."""
    for rid in engine.request_ids():
        engine.abort(rid)
