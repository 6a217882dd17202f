"""What a CPU worker's environment asks of the kernels, and pinning its threads.

`SYSHAX_QUANTIZE`, `INFERENCE_OP_MODE`, `NRC` and `CUSTOM_CPU_AFFINITY` are read (through
`shared/env.py`, the one module that reads the environment) and checked before the model is
loaded, so a bad value fails in a second with a message, not after a minute of loading.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass

from syshax.shared import env

from .affinity import format_cpu_list, resolve_affinity

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CpuKernelOptions:
    quantize: str | None = None  # q8_0 | q4_0
    op_mode: str | None = None  # "fused" | None
    nrc: int | None = None  # GEMM row tile
    cpus: tuple[int, ...] | None = None  # thread i -> cpus[i]

    @property
    def uses_kernels(self) -> bool:
        return bool(self.quantize or self.op_mode)

    def engine_kwargs(self) -> dict:
        return {"quantize": self.quantize, "op_mode": self.op_mode, "nrc": self.nrc}


def from_env(threads: int) -> CpuKernelOptions:
    """Options for a CPU worker with `threads` threads; raises EnvError / AffinityError."""
    cpus = resolve_affinity(env.custom_cpu_affinity(), threads)
    return CpuKernelOptions(
        quantize=env.quantize(),
        op_mode=env.inference_op_mode(),
        nrc=env.nrc(),
        cpus=tuple(cpus) if cpus else None,
    )


def pin_threads(opts: CpuKernelOptions) -> None:
    """Pin this process to opts.cpus, and kernel thread i to cpus[i] (before weights load, so
    their first touch lands on the right NUMA node)."""
    if not opts.cpus:
        return
    os.sched_setaffinity(0, opts.cpus)  # torch's threads, created later, inherit this mask
    if opts.uses_kernels:
        from . import lib

        arr = (ctypes.c_int * len(opts.cpus))(*opts.cpus)
        rc = lib.load().sx_pin_threads(arr, len(opts.cpus))
        if rc != 0:
            raise RuntimeError(
                f"pinning kernel threads to CPUs {list(opts.cpus)} failed (code {rc})"
            )
    log.info("threads pinned to CPUs %s", format_cpu_list(opts.cpus))
