"""Compile the native CPU kernels for this machine on first use, and cache the library.

Why a JIT build with gcc rather than a wheel or a torch extension: the kernels are compiled with
`-march=native` (AVX2/FMA here, AVX-512 or NEON elsewhere) for the host they run on, they use a
plain C ABI (no torch or Python headers: a build takes seconds, not the minute a torch
extension needs), and installing the package stays a pure-Python step.

The library is cached under `SYSHAX_KERNEL_CACHE` (default `~/.cache/syshax/kernels`), keyed
by a hash of the sources, the flags, the compiler's version and the CPU's feature flags, so a
changed source, compiler or machine gets its own build. Concurrent first starts (several
workers) serialise on a file lock; the library is written to a temporary name and renamed.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

from syshax.shared import env

log = logging.getLogger(__name__)

SOURCES = ("quant.c", "gemm.c", "tile16.c", "amx.c", "kquant.c", "ops.c", "attention.c", "decode.c")
HEADERS = ("sx.h", "simd.h", "gemm.h", "ops.h", "prof.h")
BASE_FLAGS = ("-O3", "-std=gnu11", "-fPIC", "-shared", "-fopenmp", "-ffp-contract=off")
# variant -> extra flags. "native" is what the engine uses (-march=$SYSHAX_KERNEL_MARCH, default
# native); "portable" (scalar, bit-identical results) exists so tests can check the fallback on
# any machine; "profile" is native with the fused step's per-op clocks (prof.h), for
# bench/step_profile.py only.
VARIANTS = ("native", "portable", "profile")


def _variant_flags(variant: str) -> tuple[str, ...]:
    if variant == "portable":
        return ("-DSX_PORTABLE",)
    native = (f"-march={env.kernel_march()}",)
    return native + ("-DSX_PROFILE",) if variant == "profile" else native


class KernelBuildError(RuntimeError):
    """The kernels could not be compiled; the message says why and what to install."""


def _source_dir() -> Path:
    return Path(__file__).resolve().parent / "native"


def _compiler() -> str:
    cc = env.c_compiler() or shutil.which("gcc") or shutil.which("cc")
    if not cc:
        raise KernelBuildError(
            "no C compiler found (gcc or cc on PATH, or CC): the CPU kernels "
            "(SYSHAX_QUANTIZE, INFERENCE_OP_MODE=fused) are compiled on first use; "
            "install gcc (e.g. `apt-get install gcc`)"
        )
    return cc


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cache_key(cc: str, flags: tuple[str, ...]) -> str:
    h = hashlib.sha256()
    src = _source_dir()
    for name in SOURCES + HEADERS:
        h.update(name.encode())
        h.update((src / name).read_bytes())
    h.update(" ".join(flags).encode())
    try:
        h.update(subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.encode())
    except OSError as exc:
        raise KernelBuildError(f"cannot run the C compiler {cc!r}: {exc}") from exc
    h.update(_cpu_flags().encode())
    h.update(platform.machine().encode())
    return h.hexdigest()[:16]


def library_path(variant: str = "native") -> Path:
    """The compiled library for `variant`, building it first if the cache has none."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown kernel variant {variant!r}; choose one of {', '.join(VARIANTS)}")
    cc = _compiler()
    flags = BASE_FLAGS + _variant_flags(variant)
    cache = env.kernel_cache_dir()
    target = cache / f"libsyshax_cpu-{variant}-{_cache_key(cc, flags)}.so"
    if target.is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another worker may be building the same library
        if target.is_file():
            return target
        _compile(cc, flags, target)
    return target


def _compile(cc: str, flags: tuple[str, ...], target: Path) -> None:
    src = _source_dir()
    tmp = target.with_suffix(f".{os.getpid()}.tmp")
    cmd = [cc, *flags, "-o", str(tmp), *(str(src / s) for s in SOURCES), "-lm"]
    print(
        f"syshax: compiling the CPU kernels for this machine (once, a few seconds; "
        f"cached in {target.parent}) ...",
        file=sys.stderr,
        flush=True,
    )
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise KernelBuildError(
            f"compiling the CPU kernels failed (exit {proc.returncode}):\n$ {' '.join(cmd)}\n"
            f"{proc.stderr.strip()[-4000:]}"
        )
    os.replace(tmp, target)
    log.info("CPU kernels built in %.1f s: %s", time.perf_counter() - start, target)
