"""The one module that reads environment variables (in the spirit of vLLM's `envs.py`).

Every reader looks at `os.environ` when it is called, never at import time, so tests can
monkeypatch the environment. Bad values raise `EnvError`, whose message names the variable and
what it accepts. Also reachable as attributes: `env.INFERENCE_OP_MODE` calls
`inference_op_mode()`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


class EnvError(ValueError):
    """An environment variable holds a value we cannot use; the message says which and why."""


def _raw(name: str) -> str | None:
    """The variable's value, stripped; None when unset or empty."""
    value = os.environ.get(name)
    if value is None:
        return None
    value = value.strip()
    return value or None


def _choice(name: str, allowed: tuple[str, ...], none_words: tuple[str, ...] = ()) -> str | None:
    value = _raw(name)
    if value is None or value.lower() in none_words:
        return None
    if value.lower() in allowed:
        return value.lower()
    shown = ", ".join(allowed) + (" or unset" if not none_words else ", None or unset")
    raise EnvError(f"{name}={value!r} is not valid; allowed values: {shown}")


def _positive_int(name: str) -> int | None:
    value = _raw(name)
    if value is None:
        return None
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise EnvError(f"{name}={value!r} is not valid; expected a positive integer or unset")
    return number


def debug() -> bool:
    """DEBUG: 1 turns on debug logs (also any positive integer, e.g. DEBUG=2, and
    true/yes/on; 0/false/no/off/unset = off)."""
    value = _raw("DEBUG")
    if value is None or value.lower() in _FALSE:
        return False
    if value.lower() in _TRUE or (value.isdigit() and int(value) > 0):
        return True
    raise EnvError(f"DEBUG={value!r} is not valid; allowed values: 1 or 0 (true/false, yes/no)")


def config_path() -> Path | None:
    """SYSHAX_CONFIG: the config file to use when no --config is given (~ is expanded)."""
    value = _raw("SYSHAX_CONFIG")
    return Path(value).expanduser() if value is not None else None


def redis_url() -> str | None:
    """SYSHAX_REDIS_URL: the Redis URL when no --redis-url is given (before redis.url). `syshax
    run` hands its children the farm's URL this way: a process's environment is readable only
    by its owner, its command line by every local user, and the URL may hold a password."""
    return _raw("SYSHAX_REDIS_URL")


def inference_op_mode() -> str | None:
    """INFERENCE_OP_MODE: 'fused' runs each decode step in one native call, 'none' (or 'None')
    keeps PyTorch ops; unset (None) = the default rule (fused when the weights are native
    blocks, see workers/cpu/options.py)."""
    return _choice("INFERENCE_OP_MODE", ("fused", "none"))


def omp_num_threads() -> int | None:
    """OMP_NUM_THREADS: torch/OpenMP threads of a CPU worker; unset = the config's threads."""
    return _positive_int("OMP_NUM_THREADS")


def custom_cpu_affinity() -> str | None:
    """CUSTOM_CPU_AFFINITY: cores to pin CPU worker threads to, e.g. '0-15' or '0-30:2,32-62:2'.

    Returned raw; `start-end[:step]` parsing and its checks live with the CPU worker.
    """
    return _raw("CUSTOM_CPU_AFFINITY")


def quantize() -> str | None:
    """SYSHAX_QUANTIZE: q8_0 or q4_0 (re)quantizes a CPU worker's weights to that GGML block
    format; 'none' keeps float PyTorch weights; unset (None) = the default rule (a GGUF's own
    blocks as stored, see workers/cpu/options.py)."""
    return _choice("SYSHAX_QUANTIZE", ("q8_0", "q4_0", "none"))


def huge_pages() -> str:
    """SYSHAX_HUGE_PAGES: when a CPU worker's packed weights are advised onto transparent huge
    pages. 'lazy' (default): after they are written; the kernel's khugepaged collapses them in
    the background, over minutes, and loading stays fast. 'eager': before, so the weights sit
    on 2 MiB pages from the first decode step (see workers/cpu/lib.py's weight_buffer for
    the measured trade)."""
    return _choice("SYSHAX_HUGE_PAGES", ("lazy", "eager")) or "lazy"


def prefer_eager_huge_pages() -> None:
    """SYSHAX_HUGE_PAGES=eager for this process unless the user set it: a worker loads its
    model once and decodes for hours, so a load a second longer (630 MB on a VM) buys every
    batch-1 step 4-7% (lib.weight_buffer). One-shot commands (`syshax generate`, the benches)
    keep the fast load."""
    if _raw("SYSHAX_HUGE_PAGES") is None:
        os.environ["SYSHAX_HUGE_PAGES"] = "eager"


def amx() -> bool:
    """SYSHAX_AMX: 'off' keeps the CPU kernels off Intel AMX; 'on' (default) runs the quantized
    GEMMs of prompt chunks (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K) on it where the CPU and the kernels'
    build have it (Sapphire Rapids and later, Linux >= 5.16). The same bits either way."""
    return (_choice("SYSHAX_AMX", ("on", "off")) or "on") == "on"


NRC_VALUES = (1, 2, 4, 8)


def nrc() -> int | None:
    """NRC: CPU kernel tile size (rows computed per inner step: 1, 2, 4 or 8); unset = the
    kernel's default."""
    value = _positive_int("NRC")
    if value is not None and value not in NRC_VALUES:
        raise EnvError(f"NRC={value} is not valid; allowed values: 1, 2, 4, 8 or unset")
    return value


def kernel_cache_dir() -> Path:
    """SYSHAX_KERNEL_CACHE: where the compiled CPU kernels are cached (default ~/.cache/syshax/kernels)."""
    value = _raw("SYSHAX_KERNEL_CACHE")
    if value is not None:
        return Path(value).expanduser()
    base = _raw("XDG_CACHE_HOME")
    return (Path(base) if base else Path.home() / ".cache") / "syshax" / "kernels"


def loop_trace_dir() -> Path | None:
    """SYSHAX_LOOP_TRACE: a folder where each worker writes a trace of its loop, one JSON line
    per iteration (workers/loop_trace.py; a benchmark's, off when unset)."""
    value = _raw("SYSHAX_LOOP_TRACE")
    return Path(value).expanduser() if value else None


def loop_trace_others() -> bool:
    """SYSHAX_LOOP_TRACE_OTHERS=1: the loop trace also records the CPU the farm's other
    processes take during each step."""
    return _raw("SYSHAX_LOOP_TRACE_OTHERS") in ("1", "true", "yes")


def state_dir() -> Path:
    """Where running farms publish their addresses (`shared/farm_file.py`): $XDG_STATE_HOME/
    syshax, default ~/.local/state/syshax."""
    base = _raw("XDG_STATE_HOME")
    return (Path(base) if base else Path.home() / ".local" / "state") / "syshax"


def kernel_march() -> str:
    """SYSHAX_KERNEL_MARCH: the -march the CPU kernels are compiled for (default native).

    E.g. `haswell` builds plain AVX2 + FMA code on a machine that also has AVX-512, to compare
    with an engine built for AVX2 only; an unknown value fails in the compiler with its message.
    """
    value = _raw("SYSHAX_KERNEL_MARCH") or "native"
    if not all(ch.isalnum() or ch in "-_.+" for ch in value):
        raise EnvError(f"SYSHAX_KERNEL_MARCH={value!r} is not valid; expected a gcc -march name")
    return value


def c_compiler() -> str | None:
    """CC: the C compiler that builds the CPU kernels; unset = gcc, else cc, from PATH."""
    return _raw("CC")


def rq_dashboard_username() -> str | None:
    """RQ_DASHBOARD_USERNAME: `syshax dashboard`'s basic-auth user when --username is not given
    (default admin when a password is set)."""
    return _raw("RQ_DASHBOARD_USERNAME")


def rq_dashboard_password() -> str | None:
    """RQ_DASHBOARD_PASSWORD: `syshax dashboard`'s basic-auth password when --password is not
    given; unset = no authentication. Read from the environment so `ps` never shows it."""
    return _raw("RQ_DASHBOARD_PASSWORD")


def use_vllm_in_process(cpu_kv_cache_gib: float | None) -> None:
    """Set the variables vLLM reads (not ours, so not in ENV_VARS): its engine core in this
    process (VLLM_ENABLE_V1_MULTIPROCESSING=0; the KV handoff reads its caches in-process) and,
    for the CPU build, its KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE) unless the user set
    one."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if cpu_kv_cache_gib is not None and _raw("VLLM_CPU_KVCACHE_SPACE") is None:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(cpu_kv_cache_gib)))


# GOMP_SPINCOUNT for our processes: libgomp's threads spin this many pause iterations for work
# before they sleep on a futex, instead of libgomp's 300,000 (tens of ms between steps, a core
# held busy). A fused step has ~80 barriers: a thread that waits at one longer than its spin
# sleeps and must be woken, which costs the step a wakeup. At 60,000 (~0.4-0.5 ms) most
# barrier waits end before the sleep; at 10,000 (~0.06-0.08 ms) many did not, and on the
# 2-core Zen 4 VM one stream ran 1.2x faster at 60,000 with ITL p99 32.6 vs 44.1 ms
# (docs/benchmarks.md, 2026-12-06 22:06-22:12). Where several compute processes share the
# cores (`syshax run` with CPU decode workers beside the xPU worker), each one's spin between
# steps is taken from the others: there `syshax run` gives its workers the short spin
# (docs/cpu-kernels.md, "Threads").
GOMP_SPINCOUNT_DEFAULT = "60000"
GOMP_SPINCOUNT_SHARED = "10000"
_spin_is_ours = False  # whether use_short_omp_spin set GOMP_SPINCOUNT (the user did not)


def use_short_omp_spin() -> None:
    """Set libgomp's GOMP_SPINCOUNT (not ours, so not in ENV_VARS) to GOMP_SPINCOUNT_DEFAULT
    unless the user set it or OMP_WAIT_POLICY. libgomp reads it once, when it loads: `syshax`
    calls this before any command imports torch or the kernels, and the processes it starts
    inherit it."""
    global _spin_is_ours
    if _raw("GOMP_SPINCOUNT") is None and _raw("OMP_WAIT_POLICY") is None:
        os.environ["GOMP_SPINCOUNT"] = GOMP_SPINCOUNT_DEFAULT
        _spin_is_ours = True


def spin_for_shared_cores(environ: dict[str, str]) -> dict[str, str]:
    """`environ` for processes that share the cores with other compute processes: the short
    spin, unless the user chose a spin or a wait policy (then `environ` as it is)."""
    if not _spin_is_ours or _raw("OMP_WAIT_POLICY") is not None:
        return environ
    return {**environ, "GOMP_SPINCOUNT": GOMP_SPINCOUNT_SHARED}


# name -> reader; also the list the docs describe.
ENV_VARS: dict[str, Callable[[], Any]] = {
    "DEBUG": debug,
    "SYSHAX_CONFIG": config_path,
    "SYSHAX_REDIS_URL": redis_url,
    "INFERENCE_OP_MODE": inference_op_mode,
    "OMP_NUM_THREADS": omp_num_threads,
    "CUSTOM_CPU_AFFINITY": custom_cpu_affinity,
    "SYSHAX_QUANTIZE": quantize,
    "NRC": nrc,
    "SYSHAX_HUGE_PAGES": huge_pages,
    "SYSHAX_AMX": amx,
    "SYSHAX_KERNEL_CACHE": kernel_cache_dir,
    "SYSHAX_KERNEL_MARCH": kernel_march,
    "SYSHAX_LOOP_TRACE": loop_trace_dir,
    "SYSHAX_LOOP_TRACE_OTHERS": loop_trace_others,
    "CC": c_compiler,
    "RQ_DASHBOARD_USERNAME": rq_dashboard_username,
    "RQ_DASHBOARD_PASSWORD": rq_dashboard_password,
}


def __getattr__(name: str) -> Any:
    if name in ENV_VARS:
        return ENV_VARS[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(ENV_VARS))
