"""Step-time profiles of real accelerators for the emulated engine (workers/emulated_engine.py).

A profile says how long a GPU serving a reference model (a Llama-class 7-8B model under vLLM)
takes for one engine step, from published measurements; docs/emulated-accelerator.md gives
each profile's sources, data points, fit and residuals. The step model, in seconds:

    rows == 0:  0
    otherwise:  s_w * (decode_base + decode_per_seq * decode_rows
                       + prefill_tokens / prefill_tokens_per_s)
                + s_kv * decode_per_context_token * context_tokens

`decode_base` is reading the weights once (every step does, whatever its rows), the per-row
terms grow with the batch (sampling, scheduling and the GEMMs' compute), and the context term
is reading the KV cache the step attends to. Linear in the batch because that is what the
published TPOT-vs-concurrency points up to ~16 streams support (residuals within 7%).

`s_w` and `s_kv` come from `ModelScale`: the farm runs a small model on its CPU workers while
the profile describes the reference model, and decode is memory-bound and prefill
compute-bound, so the step time of the emulated GPU is scaled by how much smaller the farm's
model is (see `model_scale`). Torch-free: the worker's xPU role imports this without a model.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

# Llama-3.1-8B(-Instruct) in bf16: the reference model of the built-in profiles.
LLAMA3_8B_PARAMS = 8_030_261_248
LLAMA3_8B_WEIGHT_BYTES = 2 * LLAMA3_8B_PARAMS
LLAMA3_8B_KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 kv heads, dim 128


class ProfileError(ValueError):
    """An accelerator profile that cannot be used (unknown name, bad file, bad field)."""


@dataclass(frozen=True)
class ModelScale:
    """Factors from the reference model to the farm's model: `weights` (parameters the GPU
    reads per decode step and computes per prompt token) and `kv` (KV bytes per token)."""

    weights: float
    kv: float
    params: int = 0  # the farm model's parameter count (for logs)
    stored_bytes: int = 0  # its weights as stored in its file (for logs; not used to scale)

    def __post_init__(self) -> None:
        if not (self.weights > 0 and self.kv > 0):
            raise ProfileError(f"scale factors must be > 0, got {self.weights}, {self.kv}")


@dataclass(frozen=True)
class AcceleratorProfile:
    name: str
    description: str
    sources: tuple[str, ...]  # URLs / citations of the numbers the fit uses
    reference_model: str
    reference_params: int
    reference_weight_bytes: int  # as the GPU holds them (bf16: 2 bytes a parameter)
    reference_kv_bytes_per_token: int
    decode_base_s: float
    decode_per_seq_s: float
    decode_per_context_token_s: float
    prefill_tokens_per_s: float
    max_batch: int  # sequences in one step (vLLM's max_num_seqs)
    kv_capacity_tokens: int  # KV positions the reference model's cache holds on this GPU

    def __post_init__(self) -> None:
        _check(self)

    def step_seconds(
        self,
        prefill_tokens: int,
        decode_rows: int,
        context_tokens: int,
        scale: float | ModelScale = 1.0,
    ) -> float:
        """Predicted seconds of one step: `prefill_tokens` prompt rows, `decode_rows` decode
        rows, `context_tokens` cached KV positions the step reads; `scale` a `ModelScale` or
        one factor for both terms."""
        if prefill_tokens < 0 or decode_rows < 0 or context_tokens < 0:
            raise ValueError("token and row counts must be >= 0")
        if prefill_tokens + decode_rows == 0:
            return 0.0
        s_w, s_kv = (scale.weights, scale.kv) if isinstance(scale, ModelScale) else (scale,) * 2
        weights = (
            self.decode_base_s
            + self.decode_per_seq_s * decode_rows
            + prefill_tokens / self.prefill_tokens_per_s
        )
        return s_w * weights + s_kv * self.decode_per_context_token_s * context_tokens


_INTS = {"reference_params", "reference_weight_bytes", "reference_kv_bytes_per_token"}
_INTS |= {"max_batch", "kv_capacity_tokens"}
_POSITIVE = {"prefill_tokens_per_s", "max_batch", "kv_capacity_tokens", "reference_params"}
_POSITIVE |= {"reference_weight_bytes", "reference_kv_bytes_per_token"}
_STRINGS = {"name", "description", "reference_model"}


def _check(p: AcceleratorProfile) -> None:
    """Raise ProfileError naming the first bad field."""
    where = f"accelerator profile {p.name!r}"
    for f in fields(p):
        value = getattr(p, f.name)
        if f.name in _STRINGS:
            if not isinstance(value, str) or not value.strip():
                raise ProfileError(f"{where}: {f.name} must be a non-empty string")
        elif f.name == "sources":
            ok = isinstance(value, tuple | list) and value
            if not ok or not all(isinstance(s, str) and s.strip() for s in value):
                raise ProfileError(f"{where}: sources must be a non-empty list of strings")
        else:
            ok_type = isinstance(value, int) if f.name in _INTS else isinstance(value, int | float)
            if isinstance(value, bool) or not ok_type or not math.isfinite(value):
                kind = "an integer" if f.name in _INTS else "a number"
                raise ProfileError(f"{where}: {f.name} must be {kind}, got {value!r}")
            if value < 0 or (f.name in _POSITIVE and value == 0):
                bound = "> 0" if f.name in _POSITIVE else ">= 0"
                raise ProfileError(f"{where}: {f.name} must be {bound}, got {value!r}")


_LLAMA3_8B = dict(
    reference_model="meta-llama/Llama-3.1-8B-Instruct, bf16/fp16",
    reference_params=LLAMA3_8B_PARAMS,
    reference_weight_bytes=LLAMA3_8B_WEIGHT_BYTES,
    reference_kv_bytes_per_token=LLAMA3_8B_KV_BYTES_PER_TOKEN,
    max_batch=256,  # vLLM's default max_num_seqs
)

# Coefficients and where they come from: docs/emulated-accelerator.md (fit script there too).
BUILTIN_PROFILES: dict[str, AcceleratorProfile] = {
    p.name: p
    for p in (
        AcceleratorProfile(
            name="h100",
            description="NVIDIA H100 80GB SXM (HBM3) serving Llama-3.1-8B with vLLM 0.21; "
            "decode fitted to a published 1/4/16-stream TPOT sweep",
            sources=(
                "https://yobitelcomm.github.io/bench/recipes/concurrency-sweep/ (vLLM 0.21.0, "
                "H100-80GB-HBM3, fp16, TPOT p50 at concurrency 1/4/16/64)",
                "https://buildkite.com/vllm/performance-benchmark/builds/9515 (vLLM nightly "
                "latency test, Llama-3.1-8B tp1 batch 8 32 in/128 out on H200: cross-check)",
            ),
            decode_base_s=5.792e-3,
            decode_per_seq_s=0.3024e-3,
            decode_per_context_token_s=52.89e-9,
            prefill_tokens_per_s=24_600.0,
            kv_capacity_tokens=415_000,
            **_LLAMA3_8B,
        ),
        AcceleratorProfile(
            name="a100-40gb",
            description="NVIDIA A100 40GB serving Llama-3.1-8B with vLLM 0.23; decode fitted "
            "to a published 1- and 8-stream sweep (1024 in / 128 out)",
            sources=(
                "https://johnmusgrave.com/p/vllm-throughput-latency-sweep-on (vLLM 0.23.0, "
                "A100 40GB, bf16: ~75 tok/s at 1 stream, 6.6x throughput at 8 streams)",
            ),
            decode_base_s=12.929e-3,
            decode_per_seq_s=0.2856e-3,
            decode_per_context_token_s=108.82e-9,
            prefill_tokens_per_s=7_770.0,
            kv_capacity_tokens=140_000,
            **_LLAMA3_8B,
        ),
        AcceleratorProfile(
            name="a10",
            description="NVIDIA A10 24GB (GDDR6, 600 GB/s) serving Llama-3.1-8B with vLLM; "
            "DERIVED, not measured: the A100 fit moved to the A10's bandwidth and compute",
            sources=(
                "https://www.baseten.co/blog/nvidia-a10-vs-a10g-for-ml-model-inference/ (A10: "
                "24 GB GDDR6, 600 GB/s; 7B LLM inference is memory-bound)",
                "https://www.nucleusbox.com/choose-gpu-for-llms-t4-a10-a100 (A10 125 FP16 "
                "TFLOPS, A100 312)",
                "https://johnmusgrave.com/p/vllm-throughput-latency-sweep-on (77% of the "
                "memory-bandwidth ceiling at 1 stream on A100, applied to the A10)",
            ),
            decode_base_s=34.762e-3,
            decode_per_seq_s=0.7130e-3,
            decode_per_context_token_s=283.71e-9,
            prefill_tokens_per_s=3_110.0,
            kv_capacity_tokens=30_000,
            **_LLAMA3_8B,
        ),
    )
}


def load_profile(name_or_path: str | Path) -> AcceleratorProfile:
    """A built-in profile by name, or one from a YAML / JSON file with the same fields."""
    key = str(name_or_path).strip()
    if key.lower() in BUILTIN_PROFILES:
        return BUILTIN_PROFILES[key.lower()]
    path = Path(key).expanduser()
    if not path.is_file():
        raise ProfileError(
            f"unknown accelerator profile {key!r}: not a built-in "
            f"({', '.join(sorted(BUILTIN_PROFILES))}) and no such file"
        )
    import yaml

    try:
        text = path.read_text()
        data = json.loads(text) if path.suffix.lower() == ".json" else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as exc:  # JSONDecodeError is a ValueError
        raise ProfileError(f"{path}: cannot read accelerator profile: {exc}") from exc
    return profile_from_dict(data, source=str(path))


def profile_from_dict(data: Any, source: str = "profile") -> AcceleratorProfile:
    if not isinstance(data, dict):
        raise ProfileError(f"{source}: an accelerator profile must be a mapping of fields")
    names = [f.name for f in fields(AcceleratorProfile)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise ProfileError(
            f"{source}: unknown field(s) {', '.join(map(str, unknown))}; "
            f"fields are: {', '.join(names)}"
        )
    missing = [n for n in names if n not in data]
    if missing:
        raise ProfileError(f"{source}: missing field(s) {', '.join(missing)}")
    values = dict(data)
    sources = values["sources"]
    values["sources"] = tuple(sources) if isinstance(sources, list | tuple) else sources
    try:
        return AcceleratorProfile(**values)
    except ProfileError as exc:
        raise ProfileError(f"{source}: {exc}") from None


# ---- scaling to the farm's model -------------------------------------------------------------


def model_scale(model: str | Path, profile: AcceleratorProfile) -> ModelScale:
    """How much smaller the farm's model (a GGUF file or an HF folder) is than the profile's
    reference: weights = parameter ratio, kv = KV-bytes-per-token ratio (same dtype).

    Element counts, not the file's stored bytes: the stored bytes measure the CPU's format (a
    Q4_1 file is 5 bits a weight), and the GPU would read the same model in its own dtype. A
    real host's CPU workers running the reference model in the farm file's format read
    (reference params / farm params) times more than the farm's CPU workers; scaling the GPU
    by the same ratio keeps the xPU:CPU speed ratio of that host."""
    path = Path(model).expanduser()
    if path.is_file():
        params, stored, kv_elems = _gguf_dims(path)
    elif (path / "config.json").is_file():
        params, stored, kv_elems = _hf_dims(path)
    else:
        raise ProfileError(f"{path}: not a GGUF file or an HF model folder (no config.json)")
    dtype_bytes = profile.reference_weight_bytes / profile.reference_params
    return ModelScale(
        weights=params / profile.reference_params,
        kv=kv_elems * dtype_bytes / profile.reference_kv_bytes_per_token,
        params=params,
        stored_bytes=stored,
    )


def _gguf_dims(path: Path) -> tuple[int, int, int]:
    """(parameters, stored tensor bytes, KV elements per token) from a GGUF header."""
    from syshax.shared.gguf_reader import GGUFError, read_gguf_info

    try:
        info = read_gguf_info(path)
    except (GGUFError, OSError) as exc:
        raise ProfileError(f"{path}: not a readable GGUF file: {exc}") from exc
    meta = info.metadata
    arch = meta.get("general.architecture")

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        return max(value) if isinstance(value, list) else value  # per-layer arrays

    try:
        layers, heads = int(get("block_count")), int(get("attention.head_count"))
        kv_heads = int(get("attention.head_count_kv", heads))
        head_dim = int(get("attention.key_length", 0) or get("embedding_length") // heads)
    except (TypeError, ValueError) as exc:
        raise ProfileError(f"{path}: GGUF metadata lacks the attention shape: {exc}") from exc
    params = sum(math.prod(t.dims) for t in info.tensors)
    stored = info.file_size - info.data_offset  # the tensor data section
    return params, stored, 2 * layers * kv_heads * head_dim


def _hf_dims(folder: Path) -> tuple[int, int, int]:
    """(parameters, safetensors bytes, KV elements per token) from config.json and the
    safetensors headers (no tensor is read)."""
    from .engine.memory import safetensors_elements

    try:
        cfg = json.loads((folder / "config.json").read_text())
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            names = set(json.loads(index.read_text())["weight_map"].values())
            files = sorted(folder / n for n in names)
        else:
            files = sorted(folder.glob("*.safetensors"))
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
        kv = 2 * int(cfg["num_hidden_layers"]) * kv_heads * head_dim
        if not files:
            raise FileNotFoundError("no *.safetensors weights found")
        return safetensors_elements(files), sum(f.stat().st_size for f in files), kv
    except (OSError, KeyError, TypeError, ValueError) as exc:
        raise ProfileError(f"{folder}: cannot read the model's shape: {exc}") from exc
