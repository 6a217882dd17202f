"""Model configuration of the Llama family, read from a Hugging Face `config.json`-shaped dict.

One parameterised architecture covers Llama 1/2/3 (llama3 rope scaling), Mistral, SmolLM,
Qwen2/2.5 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm); GGUF files are mapped to the same
dict by `gguf_weights`, so there is one place that decides what a model looks like.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import EngineError, ModelLoadError

# The context length of an engine whose caller names none (the farm's workers always do:
# max_model_len from the config), capped at what the model allows.
DEFAULT_MAX_MODEL_LEN = 2048

# architectures[0] of config.json -> (has q/k/v bias, has q/k norm)
SUPPORTED_ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    rope_scaling: dict[str, Any] | None = None
    attention_out_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    name: str = ""

    @classmethod
    def from_hf(
        cls, cfg: dict[str, Any], source: str = "config.json", name: str = ""
    ) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"{source}: architecture {arch!r} is not supported; supported: "
                + ", ".join(sorted(SUPPORTED_ARCHITECTURES))
            )
        qkv_bias, qk_norm = SUPPORTED_ARCHITECTURES[arch]
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            head_dim = cfg.get("head_dim") or hidden // heads
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            # Mistral/Qwen2 carry a sliding window; transformers only applies it when
            # use_sliding_window is on (Qwen2) or always (Mistral v0.1).
            window = cfg.get("sliding_window")
            if arch.startswith("Qwen") and not cfg.get("use_sliding_window", False):
                window = None
            return cls(
                architecture=arch,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(head_dim),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(_rope_theta(cfg)),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                qkv_bias=qkv_bias or bool(cfg.get("attention_bias", False)),
                attention_out_bias=bool(cfg.get("attention_bias", False)) and not qkv_bias,
                qk_norm=qk_norm,
                rope_scaling=_rope_scaling(cfg),
                sliding_window=int(window) if window else None,
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=tuple(int(e) for e in eos_ids),
                name=name,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(f"{source}: missing or invalid field: {exc}") from exc

    @property
    def position_limit(self) -> int:
        """The most positions the engines run this model at: attention here is full, so a
        sliding window caps it (beyond the window the model would attend differently)."""
        limit = self.max_position_embeddings
        if self.sliding_window:
            limit = min(limit, self.sliding_window)
        return limit

    def context_length(self, asked: int | None) -> int:
        """`asked` checked against `position_limit` (EngineError), or the default: the
        smaller of the limit and DEFAULT_MAX_MODEL_LEN."""
        limit = self.position_limit
        if asked is None:
            return min(limit, DEFAULT_MAX_MODEL_LEN)
        if asked > limit:
            raise EngineError(
                f"max_model_len {asked} exceeds the model's limit of {limit} positions"
            )
        return asked

    def fingerprint(self) -> str:
        """Identity of the model's shape and positional scheme; KV blobs carry it.

        Two engines with the same fingerprint can exchange KV caches whatever their dtype or
        device. The name is excluded: a GGUF and a safetensors copy of one model match.
        """
        d = asdict(self)
        for k in ("name", "bos_token_id", "eos_token_ids", "max_position_embeddings"):
            d.pop(k)
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def _rope_theta(cfg: dict[str, Any]) -> float:
    # transformers 5 moved rope_theta into rope_parameters; accept both spellings.
    params = cfg.get("rope_parameters") or {}
    return cfg.get("rope_theta") or params.get("rope_theta") or 10000.0


def _rope_scaling(cfg: dict[str, Any]) -> dict[str, Any] | None:
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not scaling:
        return None
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise ModelLoadError(f"rope scaling {kind!r} is not supported (supported: llama3)")
    return {k: v for k, v in scaling.items() if k != "rope_theta"}


def read_model_config(path: Path) -> ModelConfig:
    """The config of the model at `path` as the loader reads it (same fingerprint), without
    loading weights: a GGUF's header (and its small rope_freqs tensor) or an HF folder's
    config.json. For the engines that need the model's shape but not its weights (the
    emulated accelerator, vLLM's KV blobs)."""
    if path.is_file() and path.suffix == ".gguf":
        from .gguf_weights import open_gguf

        return ModelConfig.from_hf(open_gguf(path).hf_config, source=str(path), name=path.stem)
    from .hf_weights import read_config

    return ModelConfig.from_hf(read_config(path), source=str(path / "config.json"), name=path.name)
