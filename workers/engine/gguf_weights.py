"""Read a GGUF model file into a Hugging Face-shaped config dict and HF-named tensors.

The engine has one model description (`config.ModelConfig.from_hf`) and one tensor naming (the
Hugging Face one); this module maps a llama.cpp GGUF file onto both, so a GGUF and a
safetensors copy of the same model load through the same code afterwards.

What the mapping has to undo:

* Tensor names: ``blk.{i}.attn_q.weight`` -> ``model.layers.{i}.self_attn.q_proj.weight`` etc.
* Row order of attn_q / attn_k for the ``llama`` architecture. llama.cpp's converter
  (``convert_hf_to_gguf.py``, ``LlamaModel.permute``) reorders the output rows of q_proj and
  k_proj (weight and bias) so that its interleaved rope (rotating pairs (2j, 2j+1)) computes
  what Hugging Face's rotate-half rope computes (pairs (j, j + head_dim/2)). We apply the
  inverse (`unpermute_qk`) so the tensors equal the original HF weights. Qwen2 / Qwen3 GGUFs
  use NEOX-style rope in llama.cpp and are stored unpermuted.
* llama3 rope scaling: llama.cpp does not store its parameters as metadata but as a
  ``rope_freqs.weight`` tensor of per-frequency divisors; `_llama3_rope_scaling` recovers
  HF ``rope_scaling`` parameters that reproduce that tensor.

Reading is memory-mapped (`gguf.GGUFReader`); each tensor is dequantized on its own with
`gguf.quants.dequantize` (the same routine transformers' GGUF loader uses, so results match it
bit for bit) and converted to the requested dtype.
"""

from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFValueType
from tqdm import tqdm

from .errors import ModelLoadError

__all__ = [
    "GGUFModel",
    "ModelLoadError",
    "RAW_TYPES",
    "SUPPORTED_GGUF_ARCHITECTURES",
    "permute_qk",
    "read_gguf",
    "unpermute_qk",
]

# general.architecture -> (HF architectures[0], HF model_type)
SUPPORTED_GGUF_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}

# Block formats whose raw bytes are handed on untouched in GGUFModel.raw.
RAW_TYPES = frozenset(
    {GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0}
)

# Per-layer GGUF tensor stem -> HF module path under model.layers.{i}.
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_REQUIRED_LAYER = (
    "attn_norm.weight",
    "ffn_norm.weight",
    "attn_q.weight",
    "attn_k.weight",
    "attn_v.weight",
    "attn_output.weight",
    "ffn_gate.weight",
    "ffn_up.weight",
    "ffn_down.weight",
)
_REQUIRED_EXTRA = {
    "llama": (),
    "qwen2": ("attn_q.bias", "attn_k.bias", "attn_v.bias"),
    "qwen3": ("attn_q_norm.weight", "attn_k_norm.weight"),
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_ROPE_FREQS = "rope_freqs.weight"

# llama.cpp's converter computes rope_freqs with the config's top-level
# original_max_position_embeddings, which Llama 3.x configs do not have, so 8192 in practice.
# Only the ratios context/low_freq_factor and context/high_freq_factor shape the curve.
_LLAMA3_ORIGINAL_CONTEXT = 8192


@dataclass
class GGUFModel:
    """A parsed GGUF model: HF-shaped config, HF-named dequantized tensors, and raw blocks."""

    hf_config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    # Kept so the tokenizer can be built from the same parsed (memory-mapped) file.
    reader: gguf.GGUFReader
    # HF name -> (ggml type, raw block bytes as stored in the file) for Q4_0/Q4_1/Q8_0 tensors:
    # memory-mapped views of the file of shape (rows, bytes per row), not copies.
    # CAUTION: for the `llama` architecture the rows of self_attn.q_proj / k_proj here are
    # still in llama.cpp's permuted order (the dequantized `tensors` are not). A row
    # permutation never splits a quant block, so `unpermute_qk(raw_blocks, n_heads)` gives the
    # HF row order without requantizing (it copies, q/k are small);
    # `hf_config["num_attention_heads"]` for q, `["num_key_value_heads"]` for k.
    raw: dict[str, tuple[GGMLQuantizationType, np.ndarray]] = field(default_factory=dict)


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


def read_gguf(
    path: str | Path, dtype: torch.dtype = torch.float32, progress: bool = True
) -> GGUFModel:
    """Parse a GGUF file: HF-shaped config, HF-named tensors dequantized to ``dtype``, raw blocks.

    Raises ModelLoadError (message names the file, and the tensor where one is at fault) for a
    missing, non-GGUF or truncated file, an unsupported architecture, a tensor that is missing,
    unexpected or of a type that cannot be dequantized.
    """
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"{path}: no such file")
    try:
        reader = _Reader(path)
    except Exception as exc:  # bad magic, truncated header/tensor data, unknown value types
        raise ModelLoadError(
            f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})"
        ) from exc

    by_name = {t.name: t for t in reader.tensors}
    for t in reader.tensors:
        if t.data.nbytes != t.n_bytes:
            raise ModelLoadError(
                f"{path}: tensor {t.name!r} has {t.data.nbytes} bytes of data, expected "
                f"{t.n_bytes} (truncated file?)"
            )

    arch = _field(reader, "general.architecture", None)
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: architecture {arch!r} is not supported; supported: "
            + ", ".join(sorted(SUPPORTED_GGUF_ARCHITECTURES))
        )

    hf_config = _hf_config(reader, path, arch, by_name)
    names = _map_names(path, arch, hf_config["num_hidden_layers"], by_name)

    n_heads = hf_config["num_attention_heads"]
    n_kv_heads = hf_config["num_key_value_heads"]
    tensors: dict[str, torch.Tensor] = {}
    raw: dict[str, tuple[GGMLQuantizationType, np.ndarray]] = {}
    for gguf_name, hf_name in tqdm(
        names.items(),
        desc=f"dequantizing {path.name}",
        unit="tensor",
        file=sys.stderr,
        disable=not progress,
    ):
        t = by_name[gguf_name]
        arr = _dequantize(path, t)
        if arch == "llama":
            # Undo llama.cpp's rope row permutation (weights and biases of q and k).
            heads = None
            if hf_name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
                heads = n_heads
            elif hf_name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
                heads = n_kv_heads
            if heads is not None:
                try:
                    arr = unpermute_qk(arr, heads)
                except ValueError as exc:
                    raise ModelLoadError(f"{path}: tensor {gguf_name!r}: {exc}") from exc
        tensors[hf_name] = torch.from_numpy(np.ascontiguousarray(arr)).to(dtype)
        if t.tensor_type in RAW_TYPES:
            raw[hf_name] = (GGMLQuantizationType(t.tensor_type), t.data)

    return GGUFModel(hf_config=hf_config, tensors=tensors, reader=reader, raw=raw)


# ----------------------------------------------------------------------------- tensors


class _Reader(gguf.GGUFReader):
    """GGUFReader that names the tensor whose data runs past the end of a truncated file.

    (Plain GGUFReader fails there with a bare numpy reshape/view error.)
    """

    def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
        try:
            super()._build_tensors(start_offs, fields)
        except Exception as exc:
            culprit = _truncated_tensor(len(self.data), start_offs, fields)
            if culprit is None:
                raise
            raise ValueError(culprit) from exc


def _truncated_tensor(size: int, start_offs: int, fields: list[Any]) -> str | None:
    try:  # tensor-info parts: name_len, name, n_dims, dims, type, offset
        for f in fields:
            dims, qtype, offset = f.parts[3], int(f.parts[4][0]), int(f.parts[5][0])
            block, type_size = gguf.GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
            end = start_offs + offset + int(np.prod(dims)) * type_size // block
            if end > size:
                return (
                    f"tensor {f.name!r} ends at byte {end} but the file has only {size} bytes "
                    "(truncated)"
                )
    except Exception:  # unexpected reader internals: keep the reader's own error
        return None
    return None


def _dequantize(path: Path, t: Any) -> np.ndarray:
    """Dequantize one reader tensor to a float32 array in numpy (HF) axis order, owning its data."""
    try:
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
    except Exception as exc:
        tname = getattr(t.tensor_type, "name", t.tensor_type)
        raise ModelLoadError(
            f"{path}: tensor {t.name!r} of type {tname} cannot be dequantized "
            f"({type(exc).__name__}: {exc})"
        ) from exc
    shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists dims innermost first
    arr = np.asarray(arr, dtype=np.float32)
    if np.may_share_memory(arr, t.data):
        arr = arr.copy()  # F32 "dequantizes" to a view of the read-only memory map
    try:
        return arr.reshape(shape)
    except ValueError as exc:
        raise ModelLoadError(
            f"{path}: tensor {t.name!r} dequantized to {arr.size} values, shape says {shape}"
        ) from exc


def _map_names(path: Path, arch: str, n_layers: int, by_name: dict[str, Any]) -> dict[str, str]:
    """GGUF tensor name -> HF name for every tensor of the file; checks nothing is missing."""
    allowed = set(_LAYER_TENSORS)
    if arch != "qwen3":
        allowed -= {"attn_q_norm", "attn_k_norm"}
    names: dict[str, str] = {}
    for name in by_name:
        if name in _GLOBAL_TENSORS:
            names[name] = _GLOBAL_TENSORS[name]
            continue
        if name == _ROPE_FREQS:
            continue  # turned into hf_config["rope_scaling"]
        m = _LAYER_RE.match(name)
        if m and m.group(2) in allowed and int(m.group(1)) < n_layers:
            layer, stem, kind = m.groups()
            names[name] = f"model.layers.{int(layer)}.{_LAYER_TENSORS[stem]}.{kind}"
            continue
        raise ModelLoadError(
            f"{path}: tensor {name!r} is not part of a dense {arch} model with {n_layers} "
            "layers (mixture-of-experts and other variants are not supported)"
        )
    required = ["token_embd.weight", "output_norm.weight"]
    for i in range(n_layers):
        required += [f"blk.{i}.{s}" for s in _REQUIRED_LAYER + _REQUIRED_EXTRA[arch]]
    missing = [n for n in required if n not in by_name]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ModelLoadError(f"{path}: missing tensor(s) {', '.join(missing[:3])}{more}")
    return names


# ----------------------------------------------------------------------------- config

_MISSING = object()


def _field(reader: gguf.GGUFReader, key: str, default: Any = _MISSING) -> Any:
    """A metadata value as a Python scalar / str / list; float32 values as their shortest repr."""
    f = reader.fields.get(key)
    if f is None:
        if default is _MISSING:
            raise KeyError(key)
        return default
    if f.types and f.types[0] == GGUFValueType.ARRAY:
        return [_scalar(f.parts[i], f.types[-1]) for i in f.data]
    return _scalar(f.parts[f.data[0]], f.types[0])


def _scalar(part: np.ndarray, vtype: GGUFValueType) -> Any:
    if vtype == GGUFValueType.STRING:
        return bytes(part).decode("utf-8", errors="replace")
    value = part[0]
    if vtype == GGUFValueType.BOOL:
        return bool(value)
    if vtype == GGUFValueType.FLOAT32:
        # 1e-05 stored as float32 reads back as 9.999999747378752e-06; config.json said 1e-05.
        return float(str(np.float32(value)))
    if vtype == GGUFValueType.FLOAT64:
        return float(value)
    return int(value)


def _hf_config(
    reader: gguf.GGUFReader, path: Path, arch: str, by_name: dict[str, Any]
) -> dict[str, Any]:
    def get(key: str, default: Any = _MISSING) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    def one_int(key: str, value: Any) -> int:
        # A few converters write per-layer arrays; the engine needs one value for all layers.
        if isinstance(value, list):
            if not value or len(set(value)) != 1:
                raise ModelLoadError(f"{path}: {arch}.{key} differs between layers: {value}")
            value = value[0]
        return int(value)

    try:
        hidden = int(get("embedding_length"))
        n_layers = int(get("block_count"))
        n_heads = one_int("attention.head_count", get("attention.head_count"))
    except KeyError as exc:
        raise ModelLoadError(f"{path}: missing metadata key {exc.args[0]!r}") from exc
    n_kv_heads = one_int("attention.head_count_kv", get("attention.head_count_kv", n_heads))
    head_dim = get("attention.key_length", None)
    if head_dim is None and arch == "llama":
        head_dim = get("rope.dimension_count", None)
    head_dim = int(head_dim) if head_dim is not None else hidden // n_heads

    embd = by_name.get("token_embd.weight")
    embd_rows = int(embd.shape[1]) if embd is not None and len(embd.shape) == 2 else None
    vocab_size = get("vocab_size", None)
    if vocab_size is None:
        vocab_size = embd_rows
    if vocab_size is None:
        raise ModelLoadError(f"{path}: no {arch}.vocab_size and no token_embd.weight")
    if embd_rows is not None and int(vocab_size) != embd_rows:
        raise ModelLoadError(
            f"{path}: {arch}.vocab_size is {vocab_size} but token_embd.weight has {embd_rows} rows"
        )

    ffn = get("feed_forward_length", None)
    if ffn is None and "blk.0.ffn_gate.weight" in by_name:
        ffn = int(by_name["blk.0.ffn_gate.weight"].shape[1])
    if ffn is None:
        raise ModelLoadError(f"{path}: missing metadata key '{arch}.feed_forward_length'")

    rope_theta = float(get("rope.freq_base", 10000.0))
    hf_arch, model_type = SUPPORTED_GGUF_ARCHITECTURES[arch]
    model_name = f"{_field(reader, 'general.name', '')} {_field(reader, 'general.basename', '')}"
    is_mistral = arch == "llama" and "mistral" in model_name.lower()
    if is_mistral:
        hf_arch, model_type = "MistralForCausalLM", "mistral"

    cfg: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": int(vocab_size),
        "hidden_size": hidden,
        "intermediate_size": one_int("feed_forward_length", ffn),
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": rope_theta,
        "rope_scaling": _rope_scaling(reader, path, arch, by_name, rope_theta, head_dim),
        "max_position_embeddings": int(get("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in by_name,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id", None),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id", None),
        "attention_bias": arch == "qwen2" or "blk.0.attn_q.bias" in by_name,
    }
    pad = _field(reader, "tokenizer.ggml.padding_token_id", None)
    if pad is not None:
        cfg["pad_token_id"] = pad
    if is_mistral:
        # llama.cpp runs llama-format Mistral files with full attention; so do we.
        cfg["sliding_window"] = None
    return cfg


def _rope_scaling(
    reader: gguf.GGUFReader,
    path: Path,
    arch: str,
    by_name: dict[str, Any],
    rope_theta: float,
    head_dim: int,
) -> dict[str, Any] | None:
    if _ROPE_FREQS in by_name:
        rope_dim = int(_field(reader, f"{arch}.rope.dimension_count", head_dim))
        factors = _dequantize(path, by_name[_ROPE_FREQS]).astype(np.float64).ravel()
        return _llama3_rope_scaling(path, factors, rope_theta, rope_dim)
    kind = _field(reader, f"{arch}.rope.scaling.type", None)
    factor = _field(reader, f"{arch}.rope.scaling.factor", None)
    if kind is None:
        linear = _field(reader, f"{arch}.rope.scale_linear", None)  # older key
        if linear is not None and float(linear) != 1.0:
            return {"rope_type": "linear", "factor": float(linear)}
        return None
    if kind == "none":
        return None
    scaling: dict[str, Any] = {"rope_type": kind}
    if factor is not None:
        scaling["factor"] = float(factor)
    orig = _field(reader, f"{arch}.rope.scaling.original_context_length", None)
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


def _llama3_rope_scaling(
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
            f"{path}: tensor {_ROPE_FREQS!r} has {factors.size} values, expected {n}"
        )
    if np.allclose(factors, 1.0):
        return None
    factor = float(np.float32(factors.max()))
    ctx = float(_LLAMA3_ORIGINAL_CONTEXT)
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
                "original_max_position_embeddings": _LLAMA3_ORIGINAL_CONTEXT,
            }
    raise ModelLoadError(
        f"{path}: tensor {_ROPE_FREQS!r} does not match llama3 rope scaling "
        f"(values {np.round(factors, 4).tolist()})"
    )
