"""`syshax worker`: one worker process (one engine on one device, roles prefill and/or decode).

Engines: `native` (our own, the model on --device; `model` is its old name), `echo` (a zero-cost stand-in), `emulated` (an
emulated accelerator for the xPU role: steps sleep for a profile's predicted time) and `vllm`
(vLLM as the xPU, docs/vllm.md). What the options and the config make of a worker is decided
in workers/settings.py (`WorkerSettings.from_config`), its engine is built by workers/build.py
and the process runs in workers/process.py; this module parses the options. Light imports at
module level (the parser is built for `syshax --help`)."""

from __future__ import annotations

import argparse
import logging

from syshax.commands.renamed import with_old_names
from syshax.workers.settings import DEVICE_CLASS_ALIASES, ENGINE_ALIASES, ENGINES

log = logging.getLogger("syshax.worker")

ENGINE_HELP = (
    "native = our own engine, the model on --device (`model`, its old name, is accepted); echo = zero-cost stand-in for overhead benchmarks; "
    "emulated = an emulated accelerator for the xPU class (no model runs: each step sleeps for "
    "the time --profile predicts, the text is meaningless, handed-off KV has the real model's "
    "shape; docs/emulated-accelerator.md); vllm = vLLM serves the xPU class (xpu.vllm settings; "
    "needs vLLM in the Python running this, e.g. .venv-vllm/bin/syshax, and an HF model folder: "
    "`syshax convert` makes one; docs/vllm.md) (default: xpu.engine for the xPU class, native "
    "for the cpu class)"
)
# (flags, keywords) of each option; None defaults are decided by workers/settings.py (the rules
# in workers/worker_defaults.py).
OPTIONS: list[tuple[tuple[str, ...], dict]] = [
    (("--config",), {"help": "config file (default: $SYSHAX_CONFIG or ~/.config/syshax/config.yaml)"}),
    (("--roles",), {"default": "prefill,decode", "help": "comma list of prefill, decode (default: %(default)s)"}),
    (("--device",), {"help": "cpu, cuda, cuda:N or auto (default: xpu.device for the xPU class, cpu for the cpu class)"}),
    (("--device-class",), {"choices": ("xpu", "cpu"), "type": with_old_names("--device-class", DEVICE_CLASS_ALIASES), "help": "which decode stream this worker serves: xpu = the xPU role (even when it runs on a CPU), cpu = CPU decode; gpu, the old name of xpu, is accepted (default: cpu for a decode-only worker of the native engine on the CPU, else xpu)"}),
    (("--id",), {"dest": "worker_id", "metavar": "ID", "help": "worker id (default: <class>-<host>-<pid>)"}),
    (("--host",), {"help": "address of this worker's /metrics and /health (default: xpu.host or cpu.host)"}),
    (("--port",), {"type": int, "help": "port of this worker's /metrics and /health; 0 = none (default: xpu.port or cpu.port)"}),
    (("--redis-url",), {"help": "Redis URL (default: redis.url from the config)"}),
    (("--model",), {"help": "model path or 'default' (default: model from the config)"}),
    (("--serve",), {"metavar": "NAME", "help": "in a farm of several models (config models:), the served_model_name of the one this worker serves: its settings, its job streams (default: the first listed; a one-model config serves only its own)"}),
    (("--dtype",), {"help": "float32, bfloat16, float16 (default: dtype from the config)"}),
    (("--max-model-len",), {"type": int, "help": "context length (default: from the config)"}),
    (("--max-batch-size",), {"type": int, "help": "sequences at once (default: xpu.max_batch_size or cpu_max_batch_size)"}),
    (("--threads",), {"type": int, "help": "torch threads on a CPU device (default: $OMP_NUM_THREADS for the cpu class, else from the config: xpu.threads / cpu.threads, null = every core for an xPU worker alone on a host without accelerator, else half the cores)"}),
    (("--engine",), {"choices": ENGINES, "type": with_old_names("--engine", ENGINE_ALIASES), "help": ENGINE_HELP}),
    (("--profile",), {"metavar": "NAME|PATH", "help": "emulated engine only: accelerator profile, a built-in name (h100, a100-40gb, a10) or a YAML/JSON profile file (default: xpu.profile)"}),
    (("--step-delay",), {"type": float, "default": 0.0, "help": "echo engine only: seconds per engine step, so a generation lasts long enough to kill a worker mid-stream in reliability tests (default: %(default)s)"}),
    (("--heartbeat-ttl",), {"type": float, "help": "seconds without a heartbeat after which this worker counts as dead and its jobs are claimed by others; heartbeats are sent every second, so at least 2 (default: 10)"}),
    (("--drain-timeout",), {"type": float, "default": 30.0, "help": "seconds to finish running requests on SIGTERM (default: %(default)s)"}),
]  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    for flags, keywords in OPTIONS:
        p.add_argument(*flags, **keywords)


def run(args: argparse.Namespace) -> int:
    from syshax.shared import env, farm_file
    from syshax.shared.config import ConfigError, load_config, resolve_config_path
    from syshax.shared.logs import apply_log_level
    from syshax.workers.process import run_worker
    from syshax.workers.settings import WorkerOverrides, WorkerSettings

    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    apply_log_level(cfg.log_level)
    env.prefer_eager_huge_pages()  # before the engine packs its weights
    try:
        settings = WorkerSettings.from_config(cfg, WorkerOverrides.of(args))
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    url = farm_file.redis_url(args.redis_url, cfg, resolve_config_path(args.config), "worker")
    if not url:
        log.error("%s", farm_file.NO_FARM)
        return 2
    return run_worker(settings, url, drain_timeout=args.drain_timeout)
