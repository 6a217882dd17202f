"""Will this model fit? An estimate from the file's header, checked before anything loads.

A model that does not fit must fail in a second with numbers and advice, not get the process
OOM-killed after a minute of loading. The estimate counts what the engine keeps resident:

* weights: for a GGUF under the "stored" plan, each tensor at its stored size (the kernels'
  packed tiles are the file's bytes, rearranged), float tensors (F16/BF16 rows) as float32 and
  block types the kernels do not run as Q8_0; under "q4_0"/"q8_0" every matrix at that type;
  as float (`weights=None`) every element at the engine dtype's size. HF folders: every
  element at the engine dtype's size, counted from the safetensors headers.
* the KV cache (`KVCache.bytes_needed`),
* a draft model's weights and its KV block pool (speculative.method draft: loaded beside the
  target, counted the same way; draft_proposer.draft_footprint),
* a fixed allowance for the runtime (torch, tokenizer, buffers).

It is compared with what the machine can give: MemAvailable, and the cgroup limit where one
is set (containers).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import gguf
from gguf import GGMLQuantizationType as T

from .errors import ModelLoadError

RUNTIME_ALLOWANCE = 512 * 2**20
_Q8_0_BYTES_PER_WEIGHT = 34 / 32


@dataclass(frozen=True)
class MemoryEstimate:
    weights: int
    kv_cache: int
    runtime: int = RUNTIME_ALLOWANCE
    draft_weights: int = 0  # a draft model's (speculative.method draft), loaded beside
    draft_kv_cache: int = 0

    @property
    def total(self) -> int:
        return (
            self.weights + self.kv_cache + self.runtime + self.draft_weights + self.draft_kv_cache
        )


def gguf_weight_bytes(tensors, plan: str | None, dtype_bytes: int, native: frozenset) -> int:
    """`tensors`: GGUFFile.tensors values (type, numpy shape, nbytes)."""
    total = 0
    for t in tensors:
        n = math.prod(t.shape)
        if len(t.shape) == 1:  # norms and biases are always float32
            total += 4 * n
        elif plan is None:
            total += dtype_bytes * n
        elif plan in ("q4_0", "q8_0"):
            qtype = T.Q4_0 if plan == "q4_0" else T.Q8_0
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            total += n // block * size
        elif int(t.tensor_type) in native:
            total += t.nbytes
        elif t.tensor_type in (T.F32, T.F16, T.BF16):
            total += 4 * n
        else:
            total += int(n * _Q8_0_BYTES_PER_WEIGHT)
    return total


def safetensors_elements(files: list[Path]) -> int:
    """Number of weights in safetensors files, from their JSON headers (no tensor is read)."""
    total = 0
    for path in files:
        with open(path, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        for name, info in header.items():
            if name != "__metadata__":
                total += math.prod(info["shape"])
    return total


def available_bytes() -> int | None:
    """Memory this process can still get: MemAvailable, capped by a cgroup v2 limit."""
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except OSError:
        return None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if limit != "max" and avail is not None:
            avail = min(avail, int(limit) - used)
    except (OSError, ValueError):
        pass
    return avail


def check_fits(path: Path, estimate: MemoryEstimate, available: int | None = None) -> None:
    """Raise ModelLoadError, before anything is allocated, if the estimate exceeds memory."""
    available = available_bytes() if available is None else available
    if available is None or estimate.total <= available:
        return
    gib = 2**30
    draft = ""
    if estimate.draft_weights or estimate.draft_kv_cache:
        draft = (
            f" + draft model {estimate.draft_weights / gib:.1f} GiB + its KV cache "
            f"{estimate.draft_kv_cache / gib:.1f} GiB"
        )
    raise ModelLoadError(
        f"{path}: needs about {estimate.total / gib:.1f} GiB (weights "
        f"{estimate.weights / gib:.1f} GiB + KV cache {estimate.kv_cache / gib:.1f} GiB + "
        f"runtime {estimate.runtime / gib:.1f} GiB{draft}) but only {available / gib:.1f} GiB "
        "is available. Lower max_model_len or the batch size (cpu_max_batch_size / "
        "xpu.max_batch_size) to shrink the KV cache, use a smaller quantization (a Q4_K_M or "
        "Q4_0 GGUF, or SYSHAX_QUANTIZE=q4_0), "
        + ("a smaller draft model or speculative.method ngram, " if draft else "")
        + "or a machine with more memory"
    )


KV_SHARE_OF_FREE = 0.25  # an automatic KV cache takes at most this share of the free memory


def plan_kv_blocks(
    *,
    bytes_per_block: int,
    block_size: int,
    max_num_seqs: int,
    max_model_len: int,
    kv_cache_bytes: int | None,
    free_bytes: int | None,
) -> int:
    """How many KV blocks to allocate. Asked (`kv_cache_bytes`): what fits in it. Else room
    for every sequence at max_model_len, capped at KV_SHARE_OF_FREE of the memory free now
    (prefix caching and admission by free blocks make a smaller cache work: sequences rarely
    all reach max_model_len). Raises ValueError when not even one sequence of max_model_len
    fits."""
    per_seq = -(-max_model_len // block_size)
    full = max_num_seqs * per_seq
    if kv_cache_bytes is not None:
        blocks = kv_cache_bytes // bytes_per_block
        why = f"the KV cache budget of {kv_cache_bytes / 2**20:.0f} MiB"
    else:
        blocks = full
        why = "the memory"
        if free_bytes is not None:
            blocks = min(full, int(free_bytes * KV_SHARE_OF_FREE) // bytes_per_block)
            why = f"{KV_SHARE_OF_FREE:.0%} of the {free_bytes / 2**30:.1f} GiB free"
    if blocks < per_seq:
        raise ValueError(
            f"{why} holds {blocks * block_size} KV positions; one sequence of max_model_len "
            f"{max_model_len} needs {per_seq * block_size} ({per_seq * bytes_per_block / 2**20:.0f} "
            "MiB). Lower max_model_len or raise the KV budget (kv.cache_mib)."
        )
    return blocks
