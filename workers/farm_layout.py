"""The farm on one host (`syshax run`): which workers it starts, with which engines, and the
threads it gives the xPU worker, by the thread rule a bare `syshax worker` follows too
(`xpu_threads`); `cpu_threads(config)`: a CPU decode worker's threads (check-config, plan).

Nothing here imports torch (`syshax run`'s supervisor lays out the farm without it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from syshax.shared import env
from syshax.shared.config import Config, resolve_threads


def has_accelerator(device: str) -> bool:
    """Will the xPU worker find a CUDA device? Decided without importing torch (the supervisor
    stays small): the setting, else whether the NVIDIA driver lists a GPU."""
    if device == "cpu":
        return False
    if device.startswith("cuda"):
        return True
    gpus = "/proc/driver/nvidia/gpus"
    return os.path.isdir(gpus) and bool(os.listdir(gpus))


def farm_engines(config: Config, engine: str | None = None) -> tuple[str, str]:
    """(the xPU worker's engine, the CPU workers' engine) for `syshax run --engine` (None =
    the config's xpu.engine): echo and native run everywhere, an emulated or vLLM accelerator
    is the xPU worker's only."""
    if engine in ("native", "echo"):
        return engine, engine
    return engine or config.xpu.engine, "native"


def every_core() -> int:
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def cpu_workers(config: Config, xpu_engine: str, asked: int | None = None) -> int:
    """The farm's CPU decode workers on this host: `asked` (syshax run --cpu-workers), else
    cpu.workers, whose null means 1 beside an accelerator (an emulated one counts) and 0
    without: one worker then takes both roles on every core."""
    if asked is not None:
        return asked
    if config.cpu.workers is not None:
        return config.cpu.workers
    return 1 if _accelerator(config, xpu_engine) else 0


def _accelerator(config: Config, xpu_engine: str) -> bool:
    return xpu_engine == "emulated" or has_accelerator(config.xpu.device)


def xpu_threads(config: Config, xpu_engine: str, n_cpu: int | None = None) -> int | None:
    """Every core for an xPU worker that is the farm's only worker: no accelerator, no CPU
    decode workers (`n_cpu`, None = `cpu_workers`' default), xpu.threads null, an engine with
    threads of ours (not vLLM). Two workers would only split the same cores into halves that
    each read all the weights (docs/benchmarks.md). None otherwise: the worker's xpu.threads,
    null = half the cores (`resolve_threads`)."""
    if n_cpu is None:
        n_cpu = cpu_workers(config, xpu_engine)
    alone = not _accelerator(config, xpu_engine) and n_cpu == 0 and xpu_engine != "vllm"
    return every_core() if alone and config.xpu.threads is None else None


@dataclass(frozen=True)
class FarmLayout:
    xpu_engine: str
    cpu_engine: str
    cpu_workers: int
    # --threads for the xPU worker; None: its own default (xpu_threads by the config alone) is
    # what the farm gives it anyway
    xpu_threads: int | None


def farm_layout(
    config: Config, engine: str | None = None, asked_cpu_workers: int | None = None
) -> FarmLayout:
    """`syshax run`'s workers on this host for `--engine` and `--cpu-workers` (None: the
    config's): the xPU worker (prefill and decode) and `cpu_workers` CPU decode workers."""
    xpu_engine, cpu_engine = farm_engines(config, engine)
    n_cpu = cpu_workers(config, xpu_engine, asked_cpu_workers)
    threads = xpu_threads(config, xpu_engine, n_cpu)
    if threads is None and xpu_threads(config, xpu_engine) is not None:
        # --cpu-workers gave the farm CPU workers the config does not: the xPU worker, which
        # would take every core by the config alone, is told its share.
        threads = resolve_threads(config.xpu.threads)
    return FarmLayout(xpu_engine, cpu_engine, n_cpu, threads)


def cpu_threads(config: Config) -> int:
    """A CPU decode worker's threads: OMP_NUM_THREADS, else cpu.threads (null = half the
    cores). Raises EnvError for a bad OMP_NUM_THREADS."""
    return env.omp_num_threads() or resolve_threads(config.cpu.threads)
