"""Rope conventions of GGUF files that differ from Hugging Face's.

* llama.cpp's q/k row permutation for the ``llama`` architecture (`permute_qk`, `unpermute_qk`):
  its interleaved rope rotates pairs (2j, 2j+1), HF's rotate-half rope pairs (j, j + d/2).
* Rope scaling as HF ``rope_scaling`` parameters (`rope_scaling`). Most kinds are plain
  metadata (``{arch}.rope.scaling.*``). llama3 rope scaling is not: llama.cpp stores it as a
  ``rope_freqs.weight`` tensor of per-frequency divisors, and `llama3_rope_scaling` recovers HF
  parameters that reproduce that tensor.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from .errors import ModelLoadError

__all__ = [
    "LLAMA3_ORIGINAL_CONTEXT",
    "ROPE_FREQS",
    "llama3_rope_scaling",
    "permute_qk",
    "rope_scaling",
    "unpermute_qk",
]

ROPE_FREQS = "rope_freqs.weight"

# llama.cpp's converter computes rope_freqs with the config's top-level
# original_max_position_embeddings, which Llama 3.x configs do not have, so 8192 in practice.
# Only the ratios context/low_freq_factor and context/high_freq_factor shape the curve.
LLAMA3_ORIGINAL_CONTEXT = 8192

_Array = TypeVar("_Array", np.ndarray, torch.Tensor)


def permute_qk(w: _Array, n_heads: int) -> _Array:
    """llama.cpp's q/k row permutation (HF rotate-half layout -> interleaved), along dim 0.

    ``n_heads`` is the head count of this projection: num_attention_heads for q_proj,
    num_key_value_heads for k_proj. Within each head, rows [x_0..x_{d/2-1}, y_0..y_{d/2-1}]
    become [x_0, y_0, x_1, y_1, ...]. Works on weights (rows, cols), biases (rows,) and raw
    block arrays (rows, bytes), for numpy arrays and torch tensors.
    """
    rows = w.shape[0]
    _check_heads(rows, n_heads)
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: _Array, n_heads: int) -> _Array:
    """Inverse of `permute_qk`: llama.cpp's interleaved q/k row order -> HF rotate-half order."""
    rows = w.shape[0]
    _check_heads(rows, n_heads)
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _check_heads(rows: int, n_heads: int) -> None:
    if n_heads <= 0 or rows % (2 * n_heads):
        raise ValueError(f"{rows} rows cannot be split into {n_heads} heads of even size")


def rope_scaling(
    get: Callable[[str, Any], Any],
    path: Path,
    rope_freqs: np.ndarray | None,
    rope_theta: float,
    head_dim: int,
) -> dict[str, Any] | None:
    """HF ``rope_scaling`` (None: plain rope) of a GGUF file.

    ``get(key, default)``: the file's ``{arch}.{key}`` metadata value; ``rope_freqs``: the
    dequantized ``rope_freqs.weight`` tensor as float64, None when the file has none.
    """
    if rope_freqs is not None:
        rope_dim = int(get("rope.dimension_count", head_dim))
        return llama3_rope_scaling(path, rope_freqs.ravel(), rope_theta, rope_dim)
    kind = get("rope.scaling.type", None)
    factor = get("rope.scaling.factor", None)
    if kind is None:
        linear = get("rope.scale_linear", None)  # older key
        if linear is not None and float(linear) != 1.0:
            return {"rope_type": "linear", "factor": float(linear)}
        return None
    if kind == "none":
        return None
    scaling: dict[str, Any] = {"rope_type": kind}
    if factor is not None:
        scaling["factor"] = float(factor)
    orig = get("rope.scaling.original_context_length", None)
    if orig is not None:
        scaling["original_max_position_embeddings"] = int(orig)
    return scaling  # e.g. linear / yarn: config.ModelConfig decides whether it runs them


def _llama3_factors(
    rope_dim: int, theta: float, factor: float, low: float, high: float, context: float
) -> np.ndarray:
    """The rope_freqs vector llama.cpp's converter writes for these llama3 parameters."""
    freqs = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    wavelen = (2 * math.pi / freqs.double()).numpy()
    smooth = (context / wavelen - low) / (high - low) if high != low else np.zeros_like(wavelen)
    mid = 1.0 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen < context / high, 1.0, np.where(wavelen > context / low, factor, mid))
    return out.astype(np.float32).astype(np.float64)


def llama3_rope_scaling(
    path: Path, factors: np.ndarray, theta: float, rope_dim: int
) -> dict[str, Any] | None:
    """HF llama3 rope_scaling parameters that reproduce llama.cpp's rope_freqs divisors.

    Only the two wavelength thresholds (context/high_freq_factor, context/low_freq_factor) and
    the factor shape the curve, so we fix the context to the 8192 llama.cpp uses and solve for
    low/high_freq_factor from the values between 1 and factor, where
    ``smooth = (context / wavelen - low) / (high - low)`` is linear in 1/wavelen.
    """
    n = rope_dim // 2
    if factors.shape != (n,):
        raise ModelLoadError(
            f"{path}: tensor {ROPE_FREQS!r} has {factors.size} values, expected {n}"
        )
    if np.allclose(factors, 1.0):
        return None
    factor = float(np.float32(factors.max()))
    ctx = float(LLAMA3_ORIGINAL_CONTEXT)
    candidates = [(1.0, 4.0)]  # Llama 3.1 / 3.2 / 3.3 values
    freqs = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    wavelen = (2 * math.pi / freqs.double()).numpy()
    mid = (factors > 1.0 + 1e-6) & (factors < factor - 1e-6 * factor)
    if factor > 1.0 and mid.sum() >= 2:
        smooth = (1.0 / factors[mid] - 1.0 / factor) / (1.0 - 1.0 / factor)
        slope, intercept = np.polyfit(ctx / wavelen[mid], smooth, 1)
        if slope > 0:
            low = -intercept / slope
            high = low + 1.0 / slope
            candidates += [(round(low, 4), round(high, 4)), (float(low), float(high))]
    for low, high in candidates:
        if low <= 0 or high <= low:
            continue
        recomputed = _llama3_factors(rope_dim, theta, factor, low, high, ctx)
        if np.allclose(recomputed, factors, rtol=1e-5, atol=0.0):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": LLAMA3_ORIGINAL_CONTEXT,
            }
    raise ModelLoadError(
        f"{path}: tensor {ROPE_FREQS!r} does not match llama3 rope scaling "
        f"(values {np.round(factors, 4).tolist()})"
    )
