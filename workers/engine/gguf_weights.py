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
  ``rope_freqs.weight`` tensor of per-frequency divisors; `gguf_rope.llama3_rope_scaling`
  recovers HF ``rope_scaling`` parameters that reproduce that tensor.

Reading: the header (metadata and tensor infos) with the struct-based
`shared.models.read_gguf_info` (`gguf.GGUFReader` makes a numpy view of every element of every
metadata array and takes seconds on a 49k-token vocabulary), each tensor's bytes as a view of
one read-only `np.memmap` of the file. Each tensor is dequantized on its own with
`gguf.quants.dequantize` (the same routine transformers' GGUF loader uses, so results match it
bit for bit) and converted to the requested dtype.
"""

from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFValueType
from syshax.shared.models import GGUFError, GGUFInfo, read_gguf_info
from tqdm import tqdm

from .errors import ModelLoadError
from .gguf_rope import ROPE_FREQS, permute_qk, rope_scaling, unpermute_qk

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

# ggml types stored as plain numpy items (viewed as such, like gguf.GGUFReader does); every
# other type is viewed as uint8 blocks of shape (..., bytes per row).
_ITEM_TYPES: dict[GGMLQuantizationType, type[np.generic]] = {
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass
class GGUFModel:
    """A parsed GGUF model: HF-shaped config, HF-named dequantized tensors, and raw blocks."""

    hf_config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    # All key/value metadata of the file as plain Python values (`read_gguf_metadata`'s dict),
    # e.g. for building the tokenizer without parsing the file again.
    metadata: dict[str, Any]
    # HF name -> (ggml type, raw block bytes as stored in the file) for Q4_0/Q4_1/Q8_0 tensors:
    # memory-mapped views of the file of shape (rows, bytes per row), not copies.
    # CAUTION: for the `llama` architecture the rows of self_attn.q_proj / k_proj here are
    # still in llama.cpp's permuted order (the dequantized `tensors` are not). A row
    # permutation never splits a quant block, so `unpermute_qk(raw_blocks, n_heads)` gives the
    # HF row order without requantizing (it copies, q/k are small);
    # `hf_config["num_attention_heads"]` for q, `["num_key_value_heads"]` for k.
    raw: dict[str, tuple[GGMLQuantizationType, np.ndarray]] = field(default_factory=dict)


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
        info = read_gguf_info(path)
    except (GGUFError, OSError) as exc:  # bad magic/version, truncated header, unknown types
        raise ModelLoadError(
            f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})"
        ) from exc
    by_name = _tensor_views(path, info)

    arch = _field(info, "general.architecture", None)
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: architecture {arch!r} is not supported; supported: "
            + ", ".join(sorted(SUPPORTED_GGUF_ARCHITECTURES))
        )

    hf_config = _hf_config(info, path, arch, by_name)
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
            raw[hf_name] = (t.tensor_type, t.data)

    return GGUFModel(hf_config=hf_config, tensors=tensors, metadata=info.metadata, raw=raw)


# ----------------------------------------------------------------------------- tensors


@dataclass(frozen=True)
class _Tensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # as GGUF lists dims: innermost first
    # Read-only view of the file's bytes (np.memmap): items for _ITEM_TYPES, else uint8 blocks
    # (rows..., bytes per row), as gguf.GGUFReader shapes them.
    data: np.ndarray


def _tensor_views(path: Path, info: GGUFInfo) -> dict[str, _Tensor]:
    """GGUF name -> memory-mapped view of every tensor of the file (in file order)."""
    data = np.memmap(path, dtype=np.uint8, mode="r")
    size = data.size  # the file may have changed since its header was read: trust the map
    views: dict[str, _Tensor] = {}
    for t in info.tensors:
        try:
            qtype = GGMLQuantizationType(t.ggml_type)
        except ValueError:
            raise ModelLoadError(
                f"{path}: not a readable GGUF file (tensor {t.name!r} has unknown ggml type "
                f"{t.ggml_type})"
            ) from None
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        start = info.data_offset + t.offset
        end = start + math.prod(t.dims) * type_size // block
        if end > size:
            raise ModelLoadError(
                f"{path}: tensor {t.name!r} ends at byte {end} but the file has only {size} "
                "bytes (truncated file?)"
            )
        shape = tuple(reversed(t.dims))  # numpy order: outermost first
        item = _ITEM_TYPES.get(qtype)
        try:
            if item is not None:
                view = data[start:end].view(item).reshape(shape)
            else:
                view = data[start:end].reshape(gguf.quants.quant_shape_to_byte_shape(shape, qtype))
        except ValueError as exc:  # e.g. a row that is not a whole number of quant blocks
            raise ModelLoadError(f"{path}: tensor {t.name!r}: {exc}") from exc
        views[t.name] = _Tensor(t.name, qtype, t.dims, view)
    return views


def _dequantize(path: Path, t: _Tensor) -> np.ndarray:
    """Dequantize one tensor to a float32 array in numpy (HF) axis order, owning its data."""
    try:
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
    except Exception as exc:
        raise ModelLoadError(
            f"{path}: tensor {t.name!r} of type {t.tensor_type.name} cannot be dequantized "
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


def _map_names(path: Path, arch: str, n_layers: int, by_name: dict[str, _Tensor]) -> dict[str, str]:
    """GGUF tensor name -> HF name for every tensor of the file; checks nothing is missing."""
    allowed = set(_LAYER_TENSORS)
    if arch != "qwen3":
        allowed -= {"attn_q_norm", "attn_k_norm"}
    names: dict[str, str] = {}
    for name in by_name:
        if name in _GLOBAL_TENSORS:
            names[name] = _GLOBAL_TENSORS[name]
            continue
        if name == ROPE_FREQS:
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


def _field(info: GGUFInfo, key: str, default: Any = _MISSING) -> Any:
    """A metadata value as a Python scalar / str / list; float32 values as their shortest repr."""
    if key not in info.metadata:
        if default is _MISSING:
            raise KeyError(key)
        return default
    value = info.metadata[key]
    if info.value_types[key][-1] == GGUFValueType.FLOAT32:
        # 1e-05 stored as float32 reads back as 9.999999747378752e-06; config.json said 1e-05.
        if isinstance(value, list):
            return [float(str(np.float32(v))) for v in value]
        return float(str(np.float32(value)))
    return value


def _hf_config(
    info: GGUFInfo, path: Path, arch: str, by_name: dict[str, _Tensor]
) -> dict[str, Any]:
    def get(key: str, default: Any = _MISSING) -> Any:
        return _field(info, f"{arch}.{key}", default)

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
    rope_freqs = None  # llama3 rope scaling, see gguf_rope
    if ROPE_FREQS in by_name:
        rope_freqs = _dequantize(path, by_name[ROPE_FREQS]).astype(np.float64)
    hf_arch, model_type = SUPPORTED_GGUF_ARCHITECTURES[arch]
    model_name = f"{_field(info, 'general.name', '')} {_field(info, 'general.basename', '')}"
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
        "rope_scaling": rope_scaling(get, path, rope_freqs, rope_theta, head_dim),
        "max_position_embeddings": int(get("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in by_name,
        "bos_token_id": _field(info, "tokenizer.ggml.bos_token_id", None),
        "eos_token_id": _field(info, "tokenizer.ggml.eos_token_id", None),
        "attention_bias": arch == "qwen2" or "blk.0.attn_q.bias" in by_name,
    }
    pad = _field(info, "tokenizer.ggml.padding_token_id", None)
    if pad is not None:
        cfg["pad_token_id"] = pad
    if is_mistral:
        # llama.cpp runs llama-format Mistral files with full attention; so do we.
        cfg["sliding_window"] = None
    return cfg
