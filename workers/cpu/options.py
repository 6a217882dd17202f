"""What a CPU worker's environment asks of the kernels, the default rule, and pinning threads.

`SYSHAX_QUANTIZE`, `INFERENCE_OP_MODE`, `NRC` and `CUSTOM_CPU_AFFINITY` are read (through
`shared/env.py`, the one module that reads the environment) and checked before the model is
loaded, so a bad value fails in a second with a message, not after a minute of loading.

The default rule (`resolve_kernels`), for an engine on a CPU device:

* a GGUF runs in its own block formats ("stored": Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K used as
  they are) with the fused decode step, unless SYSHAX_QUANTIZE or INFERENCE_OP_MODE says
  otherwise: `SYSHAX_QUANTIZE=none` or `INFERENCE_OP_MODE=none` keep float PyTorch weights
  (with `INFERENCE_OP_MODE=none`, an explicit q4_0/q8_0 still quantizes, run by PyTorch ops);
* `SYSHAX_QUANTIZE=q4_0|q8_0` requantizes on purpose (fused unless INFERENCE_OP_MODE=none);
* an HF folder (fp16/bf16/fp32) keeps float PyTorch weights unless SYSHAX_QUANTIZE asks
  (`INFERENCE_OP_MODE=fused` alone runs the fused step on float32 weights);
* on a GPU device none of this applies.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
from dataclasses import dataclass

from syshax.shared import env

from .affinity import format_cpu_list, resolve_affinity

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CpuKernelOptions:
    # As asked (env): q8_0 | q4_0 | "none" | None (= the default rule); after `resolve_kernels`:
    # "stored" | q8_0 | q4_0 | None (float).
    quantize: str | None = None
    op_mode: str | None = None  # as asked: "fused" | "none" | None; resolved: "fused" | None
    nrc: int | None = None  # GEMM row tile
    cpus: tuple[int, ...] | None = None  # thread i -> cpus[i]

    @property
    def uses_kernels(self) -> bool:
        return bool(self.quantize not in (None, "none") or self.op_mode not in (None, "none"))

    def resolved(self, model_path, device: str) -> CpuKernelOptions:
        quantize, op_mode = resolve_kernels(self.quantize, self.op_mode, model_path, device)
        return dataclasses.replace(self, quantize=quantize, op_mode=op_mode)

    def engine_kwargs(self) -> dict:
        return {"quantize": self.quantize, "op_mode": self.op_mode, "nrc": self.nrc}


def resolve_kernels(
    quantize: str | None, op_mode: str | None, model_path, device: str
) -> tuple[str | None, str | None]:
    """(quantize, op_mode) for the Engine from what was asked (None = not asked), by the rule
    in this module's docstring."""
    if str(device).split(":")[0] != "cpu":
        return None, None
    from syshax.workers.engine.loader import is_gguf, resolve_model_path

    gguf = is_gguf(resolve_model_path(model_path))
    if quantize is None:
        quantize = "stored" if gguf and op_mode != "none" else "none"
    if op_mode is None:
        op_mode = "fused" if quantize != "none" else "none"
    return (None if quantize == "none" else quantize, None if op_mode == "none" else op_mode)


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
