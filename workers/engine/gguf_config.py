"""A GGUF file's metadata as a Hugging Face-shaped config dict (`config.json`'s keys).

The engine has one model description (`config.ModelConfig.from_hf`); this module maps llama.cpp's
metadata keys onto it, so a GGUF and a safetensors copy of the same model configure alike.
llama3 rope scaling is stored by llama.cpp as a `rope_freqs.weight` tensor, not as metadata:
the caller dequantizes that tensor and passes it in (`gguf_rope` turns it back into HF's
`rope_scaling`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFValueType
from syshax.shared.gguf_reader import GGUFInfo

from .errors import ModelLoadError
from .gguf_rope import rope_scaling

# general.architecture -> (HF architectures[0], HF model_type)
SUPPORTED_GGUF_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}

_MISSING = object()


def field(info: GGUFInfo, key: str, default: Any = _MISSING) -> Any:
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


def hf_config(
    info: GGUFInfo,
    path: Path,
    arch: str,
    shapes: Mapping[str, tuple[int, ...]],
    rope_freqs: np.ndarray | None,
) -> dict[str, Any]:
    """`shapes`: GGUF tensor name -> numpy-order shape (outermost first), for the values the
    metadata may leave out (vocabulary size, FFN width, whether output.weight exists)."""

    def get(key: str, default: Any = _MISSING) -> Any:
        return field(info, f"{arch}.{key}", default)

    hidden, n_layers, n_heads, n_kv_heads, head_dim = _attention(get, path, arch)
    rope_theta = float(get("rope.freq_base", 10000.0))
    hf_arch, model_type = SUPPORTED_GGUF_ARCHITECTURES[arch]
    model_name = f"{field(info, 'general.name', '')} {field(info, 'general.basename', '')}"
    is_mistral = arch == "llama" and "mistral" in model_name.lower()
    if is_mistral:
        hf_arch, model_type = "MistralForCausalLM", "mistral"

    cfg: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": _vocab_size(get, shapes, path, arch),
        "hidden_size": hidden,
        "intermediate_size": _ffn_width(get, shapes, path, arch),
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling(get, path, rope_freqs, rope_theta, head_dim),
        "max_position_embeddings": int(get("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in shapes,
        "bos_token_id": field(info, "tokenizer.ggml.bos_token_id", None),
        "eos_token_id": field(info, "tokenizer.ggml.eos_token_id", None),
        "attention_bias": arch == "qwen2" or "blk.0.attn_q.bias" in shapes,
    }
    pad = field(info, "tokenizer.ggml.padding_token_id", None)
    if pad is not None:
        cfg["pad_token_id"] = pad
    if is_mistral:
        # llama.cpp runs llama-format Mistral files with full attention; so do we.
        cfg["sliding_window"] = None
    return cfg


def _one_int(path: Path, arch: str, key: str, value: Any) -> int:
    """A few converters write per-layer arrays; the engine needs one value for all layers."""
    if isinstance(value, list):
        if not value or len(set(value)) != 1:
            raise ModelLoadError(f"{path}: {arch}.{key} differs between layers: {value}")
        value = value[0]
    return int(value)


def _attention(get: Any, path: Path, arch: str) -> tuple[int, int, int, int, int]:
    """(hidden size, layers, attention heads, KV heads, head dim) from the metadata."""
    try:
        hidden = int(get("embedding_length"))
        n_layers = int(get("block_count"))
        n_heads = _one_int(path, arch, "attention.head_count", get("attention.head_count"))
    except KeyError as exc:
        raise ModelLoadError(f"{path}: missing metadata key {exc.args[0]!r}") from exc
    kv_heads = get("attention.head_count_kv", n_heads)
    n_kv_heads = _one_int(path, arch, "attention.head_count_kv", kv_heads)
    head_dim = get("attention.key_length", None)
    if head_dim is None and arch == "llama":
        head_dim = get("rope.dimension_count", None)
    head_dim = int(head_dim) if head_dim is not None else hidden // n_heads
    return hidden, n_layers, n_heads, n_kv_heads, head_dim


def _vocab_size(get: Any, shapes: Mapping[str, tuple[int, ...]], path: Path, arch: str) -> int:
    """The metadata's vocab_size, else token_embd.weight's rows (which it must match)."""
    embd = shapes.get("token_embd.weight")
    embd_rows = int(embd[0]) if embd is not None and len(embd) == 2 else None
    vocab_size = get("vocab_size", None)
    if vocab_size is None:
        vocab_size = embd_rows
    if vocab_size is None:
        raise ModelLoadError(f"{path}: no {arch}.vocab_size and no token_embd.weight")
    if embd_rows is not None and int(vocab_size) != embd_rows:
        raise ModelLoadError(
            f"{path}: {arch}.vocab_size is {vocab_size} but token_embd.weight has {embd_rows} rows"
        )
    return int(vocab_size)


def _ffn_width(get: Any, shapes: Mapping[str, tuple[int, ...]], path: Path, arch: str) -> int:
    """The metadata's feed_forward_length, else the first layer's gate rows."""
    ffn = get("feed_forward_length", None)
    if ffn is None and "blk.0.ffn_gate.weight" in shapes:
        ffn = int(shapes["blk.0.ffn_gate.weight"][0])
    if ffn is None:
        raise ModelLoadError(f"{path}: missing metadata key '{arch}.feed_forward_length'")
    return _one_int(path, arch, "feed_forward_length", ffn)
