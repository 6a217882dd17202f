"""Turn a model path (HF folder or GGUF file) into a ready `Transformer` on a device and dtype.

Both sources yield tensors under Hugging Face names; `_target` maps each to our module layout
(q/k/v and gate/up are fused into one weight each, so a layer runs 4 GEMMs instead of 7).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from syshax.shared.models import default_model_path
from tqdm import tqdm

from . import hf_weights
from .config import ModelConfig
from .errors import ModelLoadError
from .model import Transformer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


def parse_dtype(name: str) -> torch.dtype:
    key = DTYPE_ALIASES.get(name, name)
    if key not in DTYPES:
        raise ValueError(f"dtype {name!r} is not supported; choose one of {', '.join(DTYPES)}")
    return DTYPES[key]


def resolve_model_path(model: str | Path | None) -> Path:
    if model in (None, "", "default"):
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"{path}: no such file or folder (expected an HF model folder or a .gguf file)"
        )
    return path


@dataclass
class LoadedModel:
    config: ModelConfig
    model: Transformer
    path: Path
    # GGUF only: HF name -> (ggml type, Q4_0/Q4_1/Q8_0 blocks as stored, q/k rows in HF order),
    # so a quantized engine can take them without requantizing.
    raw: dict = field(default_factory=dict)


_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


def _target(name: str) -> tuple[str, int | None] | None:
    """HF tensor name -> (our parameter name, part index for fused weights); None = ignore."""
    if name == "model.embed_tokens.weight":
        return "embed_tokens.weight", None
    if name == "model.norm.weight":
        return "norm.weight", None
    if name == "lm_head.weight":
        return "lm_head.weight", None
    m = _LAYER.fullmatch(name)
    if not m:
        return None
    layer, rest = m.groups()
    module, _, kind = rest.rpartition(".")
    if module in _FUSED:
        fused, part = _FUSED[module]
        return f"layers.{layer}.{fused}.{kind}", part
    return f"layers.{layer}.{rest}", None


def load_model(
    model: str | Path | None,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    max_model_len: int,
    progress: bool = True,
) -> LoadedModel:
    path = resolve_model_path(model)
    if path.is_file() and path.suffix == ".gguf":
        from .gguf_weights import read_gguf

        gguf = read_gguf(path, dtype=dtype, progress=progress)
        config = ModelConfig.from_hf(gguf.hf_config, source=str(path), name=path.stem)
        raw = _raw_in_hf_order(gguf)
        named: Iterable[tuple[str, torch.Tensor]] = gguf.tensors.items()
        total = len(gguf.tensors)
        progress = False  # read_gguf showed its own bar while dequantizing
    elif path.is_dir():
        config = ModelConfig.from_hf(
            hf_weights.read_config(path), source=str(path / "config.json"), name=path.name
        )
        files = hf_weights.safetensors_files(path)
        named = ((n, t) for n, t, _ in hf_weights.iter_tensors(files))
        total = hf_weights.count_tensors(files)
        raw = {}
    else:
        raise ModelLoadError(f"{path}: expected an HF model folder or a .gguf file")

    with torch.device("meta"):
        net = Transformer(config, max_model_len=1)
    params = dict(net.named_parameters())
    parts: dict[str, list[torch.Tensor | None]] = {}
    loaded: dict[str, torch.Tensor] = {}
    bar = tqdm(
        named,
        total=total,
        desc=f"loading {path.name}",
        unit="tensor",
        disable=not progress,
        file=sys.stderr,
    )
    for name, tensor in bar:
        target = _target(name)
        if target is None:
            continue
        pname, part = target
        if pname not in params:
            continue  # e.g. rotary inv_freq buffers saved by old checkpoints
        if not torch.isfinite(tensor).all():
            raise ModelLoadError(
                f"{path}: tensor {name!r} holds NaN or infinite values (corrupt file?)"
            )
        tensor = tensor.to(device=device, dtype=dtype)
        if part is None:
            loaded[pname] = tensor
        else:
            n_parts = 3 if "qkv" in pname else 2
            slot = parts.setdefault(pname, [None] * n_parts)
            slot[part] = tensor
            if all(p is not None for p in slot):
                loaded[pname] = torch.cat(slot, dim=0)  # type: ignore[arg-type]
                del parts[pname]
    if config.tie_word_embeddings or "lm_head.weight" not in loaded:
        loaded.pop("lm_head.weight", None)
        if not config.tie_word_embeddings:
            raise ModelLoadError(f"{path}: lm_head.weight is missing and embeddings are not tied")
    expected = {n for n in params if not (config.tie_word_embeddings and n == "lm_head.weight")}
    missing = sorted(expected - loaded.keys())
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ModelLoadError(f"{path}: {len(missing)} weight(s) missing: {shown}")
    for pname, tensor in loaded.items():
        if tuple(tensor.shape) != tuple(params[pname].shape):
            raise ModelLoadError(
                f"{path}: weight {pname} has shape {tuple(tensor.shape)}, "
                f"config.json implies {tuple(params[pname].shape)}"
            )
    net.load_state_dict(loaded, strict=False, assign=True)
    if config.tie_word_embeddings:
        net.lm_head.weight = net.embed_tokens.weight
    net.init_rope(max_model_len, device)
    return LoadedModel(config=config, model=net.eval(), path=path, raw=raw)


def _raw_in_hf_order(gguf) -> dict:
    """GGUFModel.raw with llama.cpp's q/k row permutation undone (llama-architecture files)."""
    from .gguf_rope import unpermute_qk

    permuted = gguf.hf_config.get("model_type") in ("llama", "mistral")
    heads = {
        "self_attn.q_proj.weight": gguf.hf_config["num_attention_heads"],
        "self_attn.k_proj.weight": gguf.hf_config["num_key_value_heads"],
    }
    out = {}
    for name, (qtype, blocks) in gguf.raw.items():
        n_heads = next((h for suffix, h in heads.items() if name.endswith(suffix)), None)
        out[name] = (qtype, unpermute_qk(blocks, n_heads) if permuted and n_heads else blocks)
    return out
