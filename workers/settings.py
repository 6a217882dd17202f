"""A worker's settings, decided once: the config and the command line's overrides -> every value
a worker process runs with. The commands parse arguments and ask.

* `WorkerSettings.from_config(config, overrides)`: what `syshax worker` runs with (its engine,
  device class, device, threads, slots, priority, ...), with the options checked against each
  other here; `build.build_engine(settings)` makes the engine from it. Each default a worker
  documents (docs/configuration.md) is computed in worker_defaults.py and nowhere else.
* The farm `syshax run` lays out on one host, and a CPU decode worker's threads: farm_layout.py.

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
from syshax.shared.config import Config, derive_model_name

from .worker_defaults import (
    ACCELERATORS,
    ROLES,
    device_of,
    handoff_slots,
    kernel_options,
    prompt_rows_while_decoding,
    prompt_stretch,
    speculative,
    threads_of,
)

# native = our own engine (the model on the worker's device: PyTorch, or the fused native step
# on a CPU), the config's xpu.engine name; the CLI's --engine takes the same names.
ENGINES = ("native", "echo", "emulated", "vllm")
# Names the command line still accepts (with a warning): the seed's `--engine model` and
# `--device-class gpu`, now native and xpu as in the config (xpu.engine, the `xpu` section).
ENGINE_ALIASES = {"model": "native"}
DEVICE_CLASS_ALIASES = {"gpu": "xpu"}


class SettingsError(ValueError):
    """Options or a config a worker cannot start with; the message says which and why."""


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
        device = device_of(config, o.device, engine, cls_, profile)
        threads = threads_of(config, o.threads, engine, cls_)
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
            kernels=kernel_options(cls_, device, threads, engine, model),
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
