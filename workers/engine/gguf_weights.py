"""Open a GGUF model file as HF-named tensors that stay in the file until asked for.

The engine has one model description (`config.ModelConfig.from_hf`) and one tensor naming (the
Hugging Face one); this module maps a llama.cpp GGUF file onto both (`gguf_config` maps the
metadata), so a GGUF and a safetensors copy of the same model load through the same code.

What the mapping has to undo:

* Tensor names: ``blk.{i}.attn_q.weight`` -> ``model.layers.{i}.self_attn.q_proj.weight`` etc.
* Row order of attn_q / attn_k for the ``llama`` architecture. llama.cpp's converter
  (``convert_hf_to_gguf.py``, ``LlamaModel.permute``) reorders the output rows of q_proj and
  k_proj (weight and bias) so that its interleaved rope (rotating pairs (2j, 2j+1)) computes
  what Hugging Face's rotate-half rope computes (pairs (j, j + head_dim/2)). We apply the
  inverse (`unpermute_qk`) so the tensors equal the original HF weights. Qwen2 / Qwen3 GGUFs
  use NEOX-style rope in llama.cpp and are stored unpermuted. A row permutation never splits a
  quant block, so the raw blocks are un-permuted the same way, without requantizing.
* llama3 rope scaling: llama.cpp does not store its parameters as metadata but as a
  ``rope_freqs.weight`` tensor of per-frequency divisors; `gguf_rope.llama3_rope_scaling`
  recovers HF ``rope_scaling`` parameters that reproduce that tensor.

Memory: `open_gguf` reads the header only (`shared.gguf_reader.read_gguf_info`, struct-based: the
gguf package's reader makes a numpy view of every element of every metadata array) and maps
the file read-only (`np.memmap`): every tensor is a view of the file, nothing is copied. A
loader then takes each tensor in turn, as its blocks (`GGUFFile.blocks`: the native kernels use
them as stored) or dequantized (`GGUFFile.float`, with `gguf.quants.dequantize`, the routine
transformers' GGUF loader uses, so results match it bit for bit), and calls
`GGUFFile.release` once it has made its own copy, which drops the tensor's file pages from the
process (madvise DONTNEED), so peak memory is what the engine keeps plus one tensor.
`read_gguf` dequantizes everything at once (tests and references).
"""

from __future__ import annotations

import math
import mmap
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType
from syshax.shared.gguf_reader import GGUFError, GGUFInfo, read_gguf_info
from tqdm import tqdm

from . import gguf_config
from .errors import ModelLoadError
from .gguf_config import SUPPORTED_GGUF_ARCHITECTURES
from .gguf_rope import ROPE_FREQS, permute_qk, unpermute_qk

__all__ = [
    "GGUFFile",
    "GGUFModel",
    "GGUFTensor",
    "ModelLoadError",
    "RAW_TYPES",
    "SUPPORTED_GGUF_ARCHITECTURES",
    "open_gguf",
    "permute_qk",
    "read_gguf",
    "unpermute_qk",
]

# Block formats whose raw bytes `read_gguf` hands on in GGUFModel.raw (the requantization
# targets and the bundled model's Q4_1).
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


@dataclass(frozen=True)
class GGUFTensor:
    name: str  # the GGUF name
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order (rows, cols): outermost first
    offset: int  # absolute byte offset in the file
    # Read-only view of the file's bytes (np.memmap): items for _ITEM_TYPES, else uint8 blocks
    # (rows..., bytes per row), as gguf.GGUFReader shapes them.
    data: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


class GGUFFile:
    """A GGUF model file mapped read-only: HF-shaped config and HF-named lazy tensors."""

    def __init__(
        self,
        path: Path,
        info: GGUFInfo,
        file_map: np.memmap,
        views: dict[str, GGUFTensor],
        arch: str,
    ):
        self.path, self.info, self.arch = path, info, arch
        self._mm: mmap.mmap | None = getattr(file_map, "_mmap", None)
        self.metadata = info.metadata
        rope_freqs = None
        if ROPE_FREQS in views:
            rope_freqs = self._dequantize(views[ROPE_FREQS]).astype(np.float64)
        shapes = {name: t.shape for name, t in views.items()}
        self.hf_config = gguf_config.hf_config(info, path, arch, shapes, rope_freqs)
        names = _map_names(path, arch, self.hf_config["num_hidden_layers"], views)
        # HF name -> tensor, in file order
        self.tensors: dict[str, GGUFTensor] = {hf: views[g] for g, hf in names.items()}

    def check_types(self, runnable: frozenset = frozenset()) -> None:
        """Raise ModelLoadError, before anything is read, if a tensor's type is neither in
        `runnable` (ggml type ids the caller uses as stored) nor one gguf-py can dequantize."""
        traits = getattr(gguf.quants, "_type_traits", None)
        if traits is None:
            return  # an unknown gguf-py layout: _dequantize reports failures per tensor
        readable = set(traits) | set(_ITEM_TYPES)
        bad = sorted(
            {
                t.tensor_type.name
                for t in self.tensors.values()
                if t.tensor_type not in readable and int(t.tensor_type) not in runnable
            }
        )
        if bad:
            raise ModelLoadError(
                f"{self.path}: tensor type(s) {', '.join(bad)} cannot be loaded (neither run by "
                "the CPU kernels nor dequantized by gguf-py); convert the file to another type"
            )

    def __contains__(self, hf_name: str) -> bool:
        return hf_name in self.tensors

    def _qk_heads(self, hf_name: str) -> int | None:
        """Heads to un-permute by, for llama-architecture q/k weights and biases; else None."""
        if self.arch != "llama":
            return None
        if ".self_attn.q_proj." in hf_name:
            return self.hf_config["num_attention_heads"]
        if ".self_attn.k_proj." in hf_name:
            return self.hf_config["num_key_value_heads"]
        return None

    def _unpermute(self, t: GGUFTensor, arr: np.ndarray, hf_name: str) -> np.ndarray:
        heads = self._qk_heads(hf_name)
        if heads is None:
            return arr
        try:
            return unpermute_qk(arr, heads)
        except ValueError as exc:
            raise ModelLoadError(f"{self.path}: tensor {t.name!r}: {exc}") from exc

    def float(self, hf_name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The tensor dequantized to `dtype` in HF row order (a new tensor owning its data)."""
        t = self.tensors[hf_name]
        arr = self._unpermute(t, self._dequantize(t), hf_name)
        return torch.from_numpy(np.ascontiguousarray(arr)).to(dtype)

    def blocks(self, hf_name: str) -> tuple[GGMLQuantizationType, np.ndarray]:
        """(ggml type, the stored bytes [rows, bytes per row]) in HF row order: a view of the
        file, except for permuted q/k rows (a copy; q and k are small)."""
        t = self.tensors[hf_name]
        data = t.data
        if t.tensor_type in _ITEM_TYPES:
            data = data.view(np.uint8).reshape(t.shape[0], -1)
        return t.tensor_type, self._unpermute(t, data, hf_name)

    def release(self, hf_name: str) -> None:
        """Drop the tensor's file pages from this process (they stay in the page cache): call
        after copying it, so a model's load never holds the whole file on top of its copy."""
        mm = self._mm
        if mm is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        t = self.tensors[hf_name]
        page = mmap.PAGESIZE
        start = t.offset // page * page
        end = min(-(-(t.offset + t.nbytes) // page) * page, len(mm))
        if end > start:
            mm.madvise(mmap.MADV_DONTNEED, start, end - start)

    def _dequantize(self, t: GGUFTensor) -> np.ndarray:
        """Dequantize one tensor to a float32 array in numpy (HF) axis order, owning its data."""
        try:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
        except Exception as exc:
            raise ModelLoadError(
                f"{self.path}: tensor {t.name!r} of type {t.tensor_type.name} cannot be "
                f"dequantized ({type(exc).__name__}: {exc})"
            ) from exc
        arr = np.asarray(arr, dtype=np.float32)
        if np.may_share_memory(arr, t.data):
            arr = arr.copy()  # F32 "dequantizes" to a view of the read-only memory map
        try:
            return arr.reshape(t.shape)
        except ValueError as exc:
            raise ModelLoadError(
                f"{self.path}: tensor {t.name!r} dequantized to {arr.size} values, shape says "
                f"{t.shape}"
            ) from exc


def open_gguf(path: str | Path) -> GGUFFile:
    """Read a GGUF file's header and map its tensors (nothing is dequantized or copied).

    Raises ModelLoadError (message names the file, and the tensor where one is at fault) for a
    missing, non-GGUF or truncated file, an unsupported architecture, a tensor that is missing,
    unexpected or of an unknown type.
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
    file_map = np.memmap(path, dtype=np.uint8, mode="r")
    views = _tensor_views(path, info, file_map)
    arch = gguf_config.field(info, "general.architecture", None)
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: architecture {arch!r} is not supported; supported: "
            + ", ".join(sorted(SUPPORTED_GGUF_ARCHITECTURES))
        )
    return GGUFFile(path, info, file_map, views, arch)


@dataclass
class GGUFModel:
    """A whole GGUF model in memory: HF-shaped config, HF-named dequantized tensors, raw blocks."""

    hf_config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    # All key/value metadata of the file as plain Python values (`read_gguf_metadata`'s dict).
    metadata: dict[str, Any]
    # HF name -> (ggml type, raw block bytes as stored in the file) for RAW_TYPES tensors:
    # memory-mapped views of the file of shape (rows, bytes per row), not copies.
    # CAUTION: for the `llama` architecture the rows of self_attn.q_proj / k_proj here are
    # still in llama.cpp's permuted order (the dequantized `tensors` are not);
    # `unpermute_qk(raw_blocks, n_heads)` gives the HF row order.
    raw: dict[str, tuple[GGMLQuantizationType, np.ndarray]] = field(default_factory=dict)


def read_gguf(
    path: str | Path, dtype: torch.dtype = torch.float32, progress: bool = True
) -> GGUFModel:
    """Every tensor of a GGUF file dequantized to `dtype` (HF names and row order), plus the
    RAW_TYPES tensors' blocks. Memory: the whole model in `dtype`; engines use `open_gguf`."""
    f = open_gguf(path)
    tensors: dict[str, torch.Tensor] = {}
    raw: dict[str, tuple[GGMLQuantizationType, np.ndarray]] = {}
    for hf_name, t in tqdm(
        f.tensors.items(),
        desc=f"dequantizing {f.path.name}",
        unit="tensor",
        file=sys.stderr,
        disable=not progress,
    ):
        tensors[hf_name] = f.float(hf_name, dtype)
        if t.tensor_type in RAW_TYPES:
            raw[hf_name] = (t.tensor_type, t.data)
    return GGUFModel(hf_config=f.hf_config, tensors=tensors, metadata=f.metadata, raw=raw)


# ----------------------------------------------------------------------------- tensors


def _tensor_views(path: Path, info: GGUFInfo, data: np.memmap) -> dict[str, GGUFTensor]:
    """GGUF name -> view of every tensor in the file's map `data` (in file order)."""
    size = data.size  # the file may have changed since its header was read: trust the map
    views: dict[str, GGUFTensor] = {}
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
        shape = tuple(int(n) for n in reversed(t.dims))  # numpy order: outermost first
        item = _ITEM_TYPES.get(qtype)
        try:
            if item is not None:
                view = data[start:end].view(item).reshape(shape)
            else:
                view = data[start:end].reshape(gguf.quants.quant_shape_to_byte_shape(shape, qtype))
        except ValueError as exc:  # e.g. a row that is not a whole number of quant blocks
            raise ModelLoadError(f"{path}: tensor {t.name!r}: {exc}") from exc
        views[t.name] = GGUFTensor(t.name, qtype, shape, start, view)
    return views


def _map_names(
    path: Path, arch: str, n_layers: int, by_name: dict[str, GGUFTensor]
) -> dict[str, str]:
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
