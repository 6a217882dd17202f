"""A worker's settings, decided once: the config and the command line's overrides -> every value
a worker process runs with. Each default a worker documents (docs/configuration.md) is computed
here and nowhere else; the commands parse arguments and ask.

* `WorkerSettings.from_config(config, overrides)`: what `syshax worker` runs with (its engine,
  device class, device, threads, slots, priority, ...); `build.build_engine(settings)` makes
  the engine from it.
* `farm_layout(config, engine, asked_cpu_workers)`: the workers `syshax run` starts on this
  host and the threads it gives the xPU worker, by the thread rule a bare `syshax worker`
  follows too.
* `cpu_threads(config)`: a CPU decode worker's threads (check-config, plan).

Nothing here imports torch when loaded (`syshax run`'s supervisor lays out the farm without
it); only resolving `xpu.device: auto` for a worker asks torch whether CUDA is there.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import uuid
from dataclasses import dataclass
from typing import Any

from syshax.shared import env
from syshax.shared.config import Config, derive_model_name, resolve_threads
from syshax.shared.config_schema import (
    DEFAULT_CPU_PROMPT_ROWS_WHILE_DECODING,
    DEFAULT_CPU_PROMPT_STRETCH,
)

# native = our own engine (the model on the worker's device: PyTorch, or the fused native step
# on a CPU), the config's xpu.engine name; the CLI's --engine takes the same names.
ENGINES = ("native", "echo", "emulated", "vllm")
# Names the command line still accepts (with a warning): the seed's `--engine model` and
# `--device-class gpu`, now native and xpu as in the config (xpu.engine, the `xpu` section).
ENGINE_ALIASES = {"model": "native"}
DEVICE_CLASS_ALIASES = {"gpu": "xpu"}
# Engines that are an accelerator whatever device this host has: they serve the xPU class.
ACCELERATORS = ("emulated", "vllm")
ROLES = frozenset({"prefill", "decode"})


class SettingsError(ValueError):
    """Options or a config a worker cannot start with; the message says which and why."""


# ---- the farm on one host (syshax run) ----------------------------------------------------


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


# ---- one worker (syshax worker) -----------------------------------------------------------


@dataclass(frozen=True)
class WorkerOverrides:
    """What `syshax worker`'s options set; None = the config's (or the rule's) value."""

    roles: str = "prefill,decode"
    device: str | None = None
    device_class: str | None = None
    engine: str | None = None
    profile: str | None = None
    model: str | None = None
    dtype: str | None = None
    max_model_len: int | None = None
    max_batch_size: int | None = None
    threads: int | None = None
    step_delay: float = 0.0
    heartbeat_ttl: float | None = None
    worker_id: str | None = None
    host: str | None = None
    port: int | None = None
    serve: str | None = None  # which model of a farm of several (config `models:`), by name

    @classmethod
    def of(cls, namespace: Any) -> WorkerOverrides:
        """From an object with these names as attributes (argparse's namespace)."""
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**{n: getattr(namespace, n) for n in names if hasattr(namespace, n)})


@dataclass(frozen=True)
class Priority:
    """A CPU decode worker's place below the farm's other processes (process.below_the_farm)."""

    sched_idle: bool
    nice: int


@dataclass(frozen=True)
class WorkerSettings:
    config: Config  # read as is where a setting is passed on whole (dispatch, xpu.vllm)
    roles: frozenset[str]
    engine: str  # native | echo | emulated | vllm
    device_class: str  # xpu = the xPU role (even on a CPU) | cpu = CPU decode
    device: str  # cpu, cuda[:N]; vllm:<device>, emulated:<profile> for those engines
    model: str  # as given: a path, or "default"
    served_model: str  # the name jobs must carry and KV blobs record
    dtype: str
    max_model_len: int
    slots: int  # decode slots (the heartbeat's capacity)
    handoff_slots: int  # engine slots beyond them, to prefill for the CPU
    max_num_batched_tokens: int
    prompt_rows_while_decoding: int | None
    prompt_stretch: float | None
    kv_cache_bytes: int | None
    threads: int
    kernels: Any = None  # CpuKernelOptions of a model engine on the CPU, else None
    profile: Any = None  # AcceleratorProfile of the emulated engine, else None
    vllm: Any = None  # VllmArgs of the vLLM engine, else None
    speculative: Any = None  # SpecConfig of the native engine when the config asks, else None
    step_delay: float = 0.0
    priority: Priority | None = None
    worker_id: str = ""
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0
    heartbeat_ttl: float | None = None
    stream_model: str = ""  # the served model whose job streams it reads ("" = one-model farm)

    @property
    def engine_slots(self) -> int:
        return self.slots + self.handoff_slots

    @classmethod
    def from_config(cls, config: Config, overrides: WorkerOverrides) -> WorkerSettings:
        """Every worker setting from the config and the overrides; SettingsError (a ValueError)
        names what does not fit, before anything heavy loads."""
        from syshax.workers.cpu.affinity import AffinityError
        from syshax.workers.engine.errors import EngineError

        try:
            key, config = served_model(config, overrides.serve)
            return dataclasses.replace(cls._resolve(config, overrides), stream_model=key)
        except (env.EnvError, AffinityError, EngineError) as exc:
            raise SettingsError(str(exc)) from None

    @classmethod
    def _resolve(cls, config: Config, o: WorkerOverrides) -> WorkerSettings:
        roles = frozenset(r.strip() for r in o.roles.split(",") if r.strip())
        if not roles or not roles <= ROLES:
            raise SettingsError(f"--roles must be a comma list of prefill, decode; got {o.roles!r}")
        engine, cls_ = engine_and_class(config, o, roles)
        profile = emulated_profile(config, o, engine, cls_)
        if engine == "vllm":
            _check_vllm(config, o, cls_)
        _check_pacing(o, engine)
        device = _device(config, o, engine, cls_, profile)
        threads = _threads(config, o, engine, cls_)
        slots = o.max_batch_size or (
            config.xpu.max_batch_size if cls_ == "xpu" else config.cpu_max_batch_size
        )
        handoff = handoff_slots(config, engine, cls_, device, roles)
        section = config.xpu if cls_ == "xpu" else config.cpu
        model = o.model or config.model
        vllm = None
        if engine == "vllm":  # the farm's slots (handoff's too), context length, prefix caching
            from .vllm.setup import worker_args

            vllm = worker_args(config, o, slots + handoff)
        return cls(
            config=config,
            roles=roles,
            engine=engine,
            device_class=cls_,
            device=device,
            model=model,
            served_model=config.served_model_name or derive_model_name(model),
            dtype=o.dtype or config.dtype,
            max_model_len=o.max_model_len or config.max_model_len,
            slots=slots,
            handoff_slots=handoff,
            max_num_batched_tokens=max(config.max_num_batched_tokens, slots + handoff),
            prompt_rows_while_decoding=prompt_rows_while_decoding(config, device),
            prompt_stretch=prompt_stretch(config, device),
            kv_cache_bytes=config.kv.cache_mib * 2**20 if config.kv.cache_mib else None,
            threads=threads,
            kernels=_kernels(cls_, device, threads, engine, model),
            profile=profile,
            vllm=vllm,
            speculative=speculative(config, engine),
            step_delay=o.step_delay,
            priority=Priority(config.cpu.sched_idle, config.cpu.nice) if cls_ == "cpu" else None,
            worker_id=o.worker_id
            or f"{cls_}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}",
            metrics_host=o.host or section.host,
            metrics_port=section.port if o.port is None else o.port,
            heartbeat_ttl=o.heartbeat_ttl,
        )


def served_model(config: Config, name: str | None) -> tuple[str, Config]:
    """(stream key, the model's own config) of the model `--serve` names (None = the default:
    the first of `models:`, or the one model)."""
    try:
        served = config.served_model(name)
    except KeyError:
        names = ", ".join(m.config.model_id for m in config.served_models())
        raise SettingsError(f"--serve {name!r}: the config serves {names}") from None
    return served.key, served.config


def engine_and_class(config: Config, o: WorkerOverrides, roles: frozenset[str]) -> tuple[str, str]:
    """(engine, device class): an emulated or vLLM accelerator is the xPU class; else the
    class is cpu for a decode-only worker on the CPU, else xpu; without --engine the xPU class
    follows xpu.engine and the CPU class runs the native engine."""
    engine = o.engine
    if o.device_class:
        cls = o.device_class
    elif engine in ACCELERATORS:
        cls = "xpu"
    else:
        cls = "cpu" if roles == {"decode"} and (o.device or "cpu") == "cpu" else "xpu"
    if engine is None:
        engine = config.xpu.engine if cls == "xpu" else "native"
    return engine, cls


def emulated_profile(config: Config, o: WorkerOverrides, engine: str, cls: str):
    """The accelerator profile of an emulated-engine worker (None for the other engines);
    raises SettingsError with the reason the options do not fit."""
    if engine != "emulated":
        if o.profile:
            raise SettingsError("--profile is for the emulated engine only (--engine emulated)")
        return None
    if cls != "xpu":
        raise SettingsError("the emulated engine is an accelerator: it serves the xPU class (xpu)")
    if o.device:
        raise SettingsError("--device does not apply to the emulated engine (it runs no model)")
    from .accelerator_profiles import ProfileError, load_profile

    try:
        return load_profile(o.profile or config.xpu.profile)
    except ProfileError as exc:
        where = "--profile" if o.profile else "xpu.profile"
        raise SettingsError(f"{where}: {exc}") from None


def _check_vllm(config: Config, o: WorkerOverrides, cls: str) -> None:
    """What stops `--engine vllm` before anything heavy loads (vllm/setup.py: another class,
    --device, vLLM not importable, settings vLLM refuses, a GGUF model)."""
    from .vllm.setup import check_worker

    try:
        check_worker(config, o, cls)
    except ValueError as exc:
        raise SettingsError(str(exc)) from None


def _check_pacing(o: WorkerOverrides, engine: str) -> None:
    if o.step_delay and engine != "echo":
        raise SettingsError("--step-delay is for the echo engine only (--engine echo)")
    if o.step_delay < 0:
        raise SettingsError(f"--step-delay must be >= 0, got {o.step_delay}")
    if o.heartbeat_ttl is not None and o.heartbeat_ttl < 2:
        raise SettingsError(f"--heartbeat-ttl must be at least 2 seconds, got {o.heartbeat_ttl}")


def _device(config: Config, o: WorkerOverrides, engine: str, cls: str, profile) -> str:
    """The device the worker runs and reports: vLLM picks its own, an emulated accelerator is
    named for its profile (what the heartbeat and the token events show)."""
    if engine == "vllm":
        return f"vllm:{_resolve_device('auto')}"
    if profile is not None:
        return f"emulated:{profile.name}"
    return _resolve_device(o.device or (config.xpu.device if cls == "xpu" else "cpu"))


def _resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch  # the one question only torch answers: is there a CUDA device?

    return "cuda" if torch.cuda.is_available() else "cpu"


def _threads(config: Config, o: WorkerOverrides, engine: str, cls: str) -> int:
    """--threads; a CPU decode worker's `cpu_threads`; the xPU class: every core when it is
    the farm's only worker (`xpu_threads`, as `syshax run` lays it out), else xpu.threads
    (null = half the cores)."""
    if o.threads:
        return o.threads
    if cls == "cpu":
        return cpu_threads(config)
    return xpu_threads(config, engine) or resolve_threads(config.xpu.threads)


def _kernels(cls: str, device: str, threads: int, engine: str, model: str):
    """The native kernels' options for a model worker on a CPU device, checked before loading
    and resolved by the default rule (workers/cpu/options.py: a GGUF runs its own blocks with
    the fused step); None for GPU, echo and accelerator workers. CUSTOM_CPU_AFFINITY pins
    CPU-class workers only (an xPU-role worker on a CPU-only host shares the cores unpinned)."""
    if device != "cpu" or engine != "native":
        return None
    from .cpu.options import from_env

    opts = from_env(threads)
    if cls != "cpu":
        opts = dataclasses.replace(opts, cpus=None)
    return opts.resolved(model, device)


def handoff_slots(config: Config, engine: str, cls: str, device: str, roles: frozenset[str]) -> int:
    """One engine slot beyond the decode slots for an accelerator that prefills and decodes
    in a farm that may offload decode: a prompt is prefilled there for the CPU while every
    decode slot is busy (WorkerOptions.handoff_slots). Not for the xPU role on a CPU (the
    farm without an accelerator has no CPU decoders to offload to)."""
    accelerator = engine in ACCELERATORS or device != "cpu"
    offloads = config.auto_pd_offload and config.decode_device == "auto"
    return int(cls == "xpu" and accelerator and offloads and roles >= ROLES)


def speculative(config: Config, engine: str) -> Any:
    """The native engine's speculative decoding (a SpecConfig), None when off or another
    engine runs (vLLM has its own; the stand-ins compute nothing to verify)."""
    section = config.speculative
    if engine != "native" or section.method == "none":
        return None
    from .engine.speculative import SpecConfig

    draft = section.draft_model if section.method == "draft" else None
    return SpecConfig(
        method=section.method, num_tokens=section.num_tokens, draft_model=draft
    ).check()


def prompt_rows_while_decoding(config: Config, device: str) -> int | None:
    """The config's value; null = a cap on a CPU engine (whose prompt rows cost a running
    stream ~5 ms each at 1B on 2 cores), none on an accelerator (where they cost microseconds
    and a smaller chunk only slows the prefill)."""
    if config.prompt_rows_while_decoding is not None:
        return config.prompt_rows_while_decoding
    return DEFAULT_CPU_PROMPT_ROWS_WHILE_DECODING if device == "cpu" else None


def prompt_stretch(config: Config, device: str) -> float | None:
    """The config's value; null = the time rule on a CPU engine (its prompt rows cost a
    stream's gap in proportion), none on an accelerator (a flat step: the cap alone)."""
    if config.prompt_stretch is not None:
        return config.prompt_stretch
    return DEFAULT_CPU_PROMPT_STRETCH if device == "cpu" else None
