"""What a draft model (speculative.method draft, draft_proposer.py) will hold beside its
target, known before either loads, for the target's memory check and KV sizing
(model_runner.py): its file, its weights as the loader will keep them, its KV bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import read_model_config
from .errors import EngineError
from .kv_cache import KVCache, KVDType, fitting
from .loader import is_gguf, parse_dtype, resolve_model_path, weight_bytes


def draft_path(spec: Any) -> Path:
    """The file or folder of `spec.draft_model`; EngineError naming it when there is none."""
    given = Path(spec.draft_model).expanduser()
    if spec.draft_model != "default" and not given.exists():
        raise EngineError(
            f"speculative.draft_model: no such file or folder: {given.absolute()} (a draft "
            "model is a .gguf file or an HF model folder; a relative path in a config file is "
            "relative to the file's folder)"
        )
    return resolve_model_path(spec.draft_model if spec.draft_model == "default" else given)


@dataclass(frozen=True)
class DraftFootprint:
    """What a draft model will hold beside its target, known before either loads: its weights
    (loader.weight_bytes, as the target's are counted) and its KV bytes per block of
    positions (its pool has as many blocks as the target's)."""

    path: Path
    config: Any  # its ModelConfig
    weights: int
    bytes_per_block: int  # at the engine's block_size and KV dtype

    def kv_bytes(self, num_seqs: int, max_model_len: int, kv_dtype: KVDType) -> int:
        kv_dtype = fitting(self.config, kv_dtype)
        return KVCache.bytes_needed(self.config, num_seqs, max_model_len, kv_dtype)


def draft_footprint(opts: Any, kv_dtype: KVDType) -> DraftFootprint | None:
    """The footprint of `opts.speculative`'s draft model (None without one), loaded as
    `load_drafter` will: the same quantize plan where the draft is a GGUF, float otherwise."""
    spec = opts.speculative
    if spec is None or spec.method != "draft":
        return None
    path = draft_path(spec)
    weights = opts.quantize if opts.quantize is not None and is_gguf(path) else None
    config = read_model_config(path)
    size = weight_bytes(path, weights, parse_dtype(opts.dtype))
    per_block = KVCache.bytes_per_block(config, opts.block_size, fitting(config, kv_dtype))
    return DraftFootprint(path, config, size, per_block)
