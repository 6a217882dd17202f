"""Turn a model path (HF folder or GGUF file) into a ready `Transformer` on a device and dtype.

Both sources yield tensors under Hugging Face names; `_target` maps each to our module layout
(q/k/v and gate/up are fused into one weight each, so a layer runs 4 GEMMs instead of 7).

`weights` says what the projections (q/k/v, o, gate/up, down and the LM head) become:

* None: float `nn.Linear` in `dtype` (the PyTorch path; any device).
* "stored" (GGUF on the CPU): the file's own blocks, used as stored by the native kernels
  (`workers/cpu/quantized.py`); the token embedding stays in its blocks too and rows are
  dequantized when looked up. Nothing is ever dequantized to a float copy of the model.
* "q4_0" / "q8_0" (GGUF on the CPU): blocks of that type; tensors already in it are taken as
  stored, the others are dequantized and requantized one at a time.

Tensors are taken one at a time from the file's memory map and released once copied
(`GGUFFile.release`), so peak memory is what the model keeps plus one tensor.
"""

from __future__ import annotations

import gc
import re
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from syshax.shared.default_model import default_model_path
from tqdm import tqdm

from . import hf_weights, memory
from .config import ModelConfig
from .errors import ModelLoadError
from .model import Transformer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
WEIGHT_PLANS = ("stored", "q4_0", "q8_0")


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


def is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix == ".gguf"


@dataclass
class LoadedModel:
    config: ModelConfig
    model: Transformer
    path: Path
    # GGUF loaded as float only: HF name -> (ggml type, Q4_0/Q4_1/Q8_0 blocks as stored, q/k
    # rows in HF order), so `quantize_model` can take them afterwards without requantizing.
    raw: dict = field(default_factory=dict)
    # What the projections became: None (float) or a `quantized.QuantizeReport`.
    report: object | None = None


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


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Python's cyclic GC off while a model loads: the load makes thousands of modules, tensor
    views and dicts, none of them garbage, and each generation-2 pass walks torch's whole object
    graph (7% of a 1B GGUF load's samples under perf)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@_gc_paused()
def load_model(
    model: str | Path | None,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    max_model_len: int,
    progress: bool = True,
    weights: str | None = None,
    nrc: int = 0,
    kv_bytes: Callable[[ModelConfig], int] | None = None,
    draft_bytes: Callable[[ModelConfig], tuple[int, int]] | None = None,
) -> LoadedModel:
    """`kv_bytes(config)`: the KV cache the caller will allocate; with it, the load fails with
    a clear ModelLoadError before any tensor is read when weights + KV cache cannot fit.
    `draft_bytes(config)`: (weights, KV cache) of a draft model to be loaded beside this one,
    counted in that check too."""

    def estimate(weights: int, config: ModelConfig) -> memory.MemoryEstimate:
        kv = kv_bytes(config) if kv_bytes is not None else 0
        dw, dkv = draft_bytes(config) if draft_bytes is not None else (0, 0)
        return memory.MemoryEstimate(weights, kv, draft_weights=dw, draft_kv_cache=dkv)

    path = resolve_model_path(model)
    device = torch.device(device)
    if weights is not None and weights not in WEIGHT_PLANS:
        raise ValueError(f"weights {weights!r} is not one of {', '.join(WEIGHT_PLANS)} or None")
    if weights is not None and (device.type != "cpu" or not is_gguf(path)):
        raise ModelLoadError(
            f"{path}: weights={weights!r} loads a GGUF file's blocks for the CPU kernels; "
            "quantize other models after loading (quantized.quantize_model)"
        )
    report = None
    raw: dict = {}
    if is_gguf(path):
        from .gguf_weights import open_gguf

        gg = open_gguf(path)
        config = ModelConfig.from_hf(gg.hf_config, source=str(path), name=path.stem)
        native = _native_types() if weights == "stored" else frozenset()
        gg.check_types(native)
        if kv_bytes is not None:
            size = memory.gguf_weight_bytes(gg.tensors.values(), weights, _itemsize(dtype), native)
            memory.check_fits(path, estimate(size, config))
        net = _meta_model(config)
        if weights is not None:
            from syshax.workers.cpu.gguf_load import load_gguf_projections

            report = load_gguf_projections(net, gg, weights, nrc, progress)
        else:
            raw = _raw_blocks(gg)
        named = _gguf_tensors(gg, dtype, skip=report.consumed if report else frozenset())
        total = len(gg.tensors) - (len(report.consumed) if report else 0)
    elif path.is_dir():
        config = ModelConfig.from_hf(
            hf_weights.read_config(path), source=str(path / "config.json"), name=path.name
        )
        files = hf_weights.safetensors_files(path)
        if kv_bytes is not None:
            size = memory.safetensors_elements(files) * _itemsize(dtype)
            memory.check_fits(path, estimate(size, config))
        net = _meta_model(config)
        named = ((n, t) for n, t, _ in hf_weights.iter_tensors(files))
        total = hf_weights.count_tensors(files)
    else:
        raise ModelLoadError(f"{path}: expected an HF model folder or a .gguf file")

    bar = tqdm(
        named,
        total=total,
        desc=f"loading {path.name}",
        unit="tensor",
        # After the block matrices (their own bar) only norms are left: no second bar.
        disable=not progress or report is not None,
        file=sys.stderr,
    )
    _assign_float(net, config, path, bar, dtype, device)
    net.init_rope(max_model_len, device)
    return LoadedModel(config=config, model=net.eval(), path=path, raw=raw, report=report)


def weight_bytes(path: Path, weights: str | None, dtype: torch.dtype) -> int:
    """What `load_model(path, weights=weights, dtype=dtype)` keeps of the weights, from the
    file's header (memory.py's rules; nothing is read)."""
    if is_gguf(path):
        from .gguf_weights import open_gguf

        native = _native_types() if weights == "stored" else frozenset()
        tensors = open_gguf(path).tensors.values()
        return memory.gguf_weight_bytes(tensors, weights, _itemsize(dtype), native)
    return memory.safetensors_elements(hf_weights.safetensors_files(path)) * _itemsize(dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _native_types() -> frozenset:
    from syshax.workers.cpu import lib

    return lib.NATIVE_TYPES


@contextmanager
def _no_weight_init() -> Iterator[None]:
    """Build modules without initializing their weights (the file provides them). On the meta
    device nn.Embedding's normal_ init imports torch._dynamo: 2.4 s and 85 MB per process."""
    saved = torch.nn.Linear.reset_parameters, torch.nn.Embedding.reset_parameters
    torch.nn.Linear.reset_parameters = torch.nn.Embedding.reset_parameters = lambda self: None
    try:
        yield
    finally:
        torch.nn.Linear.reset_parameters, torch.nn.Embedding.reset_parameters = saved


def _meta_model(config: ModelConfig) -> Transformer:
    with torch.device("meta"), _no_weight_init():
        return Transformer(config, max_model_len=1)


def _gguf_tensors(gg, dtype: torch.dtype, skip: frozenset) -> Iterator[tuple[str, torch.Tensor]]:
    """The file's tensors not in `skip`, each dequantized when reached and its pages released."""
    for name in gg.tensors:
        if name in skip:
            continue
        tensor = gg.float(name, dtype)
        gg.release(name)
        yield name, tensor


def _raw_blocks(gg) -> dict:
    from .gguf_weights import RAW_TYPES

    out = {}
    for name, t in gg.tensors.items():
        if t.tensor_type in RAW_TYPES:
            out[name] = gg.blocks(name)
    return out


def _assign_float(
    net: Transformer,
    config: ModelConfig,
    path: Path,
    named: Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """Load float tensors into the meta model's remaining parameters (fusing q/k/v and
    gate/up), checking names, shapes and values."""
    params = dict(net.named_parameters())
    parts: dict[str, list[torch.Tensor | None]] = {}
    loaded: dict[str, torch.Tensor] = {}
    for name, tensor in named:
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
    tied = config.tie_word_embeddings and isinstance(net.lm_head, torch.nn.Linear)
    if tied or "lm_head.weight" not in loaded:
        loaded.pop("lm_head.weight", None)
        if "lm_head.weight" in params and not tied:
            raise ModelLoadError(f"{path}: lm_head.weight is missing and embeddings are not tied")
    expected = {n for n in params if not (tied and n == "lm_head.weight")}
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
    if tied:
        net.lm_head.weight = net.embed_tokens.weight
