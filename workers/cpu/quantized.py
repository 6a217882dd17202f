"""Weights in GGML blocks for the native kernels, by swapping modules (gpt-fast style).

Two ways in:

* `load_gguf_projections` (the default for a GGUF on the CPU): while a GGUF loads, every
  projection (q/k/v, o, gate/up, down) and the LM head becomes a `QuantLinear` over the file's
  own blocks ("stored": Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K as they are, F16/F32 as float32
  rows), and the token embedding a `QuantEmbedding` that dequantizes the rows it looks up. No
  float copy of a quantized tensor is ever made. A fused matrix whose parts the file stores in
  different types (Q4_K_M keeps some layers' attn_v in Q6_K next to Q4_K q/k) is a stack of
  parts, one block type each. With "q4_0" / "q8_0" (`SYSHAX_QUANTIZE`) tensors in another type
  are dequantized and requantized one at a time.
* `quantize_model`: after a float load (HF folders), nn.Linear -> QuantLinear in q8_0 | q4_0.

Blocks that a GGUF file already stores in the wanted type are taken as they are (no
requantization: the blocks equal the file's bytes, with llama.cpp's q/k row permutation undone
row by row); others are quantized from float with ggml's reference rounding, so the result
equals what llama.cpp's quantizer writes.

Each weight matrix is repacked into the kernels' tiles of 8 rows by the kernel threads that
will read them (sx_pack): with pinned threads, first touch puts every thread's rows on its own
NUMA node.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from . import lib

log = logging.getLogger(__name__)

# Our fused parameter -> the Hugging Face tensors it is made of, in row order.
_SOURCES = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


class QuantLinear(nn.Module):
    """y = x @ W^T + b with W in GGML blocks packed in tiles of 8 rows, by the native GEMM.

    `blocks` is the packed buffer (`lib.unpack` gives the GGML row-major blocks back). A matrix
    whose row ranges are stored in different types (`parts`: (type, rows, byte offset in
    `blocks`) each, in row order) is one stacked matrix to the kernels; `qtype` is then -1."""

    def __init__(
        self,
        qtype: int,
        blocks: torch.Tensor,
        in_features: int,
        out_features: int,
        bias: torch.Tensor | None,
        nrc: int = 0,
        parts: list[tuple[int, int, int]] | None = None,
    ):
        super().__init__()
        self.in_features, self.out_features, self.nrc = in_features, out_features, nrc
        self.parts = parts or [(qtype, out_features, 0)]
        self.qtype = self.parts[0][0] if len(self.parts) == 1 else -1
        self.register_buffer("blocks", blocks, persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        if len(self.parts) == 1:
            self.mat = lib.make_mat(qtype, blocks, out_features, in_features, bias)
        else:
            mats, row = [], 0
            ends = [off for _, _, off in self.parts[1:]] + [blocks.numel()]
            for (ptype, rows, off), end in zip(self.parts, ends, strict=True):
                data = blocks[off:end]
                if ptype == lib.F32:
                    data = data.view(torch.float32)
                part_bias = None if bias is None else bias[row : row + rows]
                mats.append(lib.make_mat(ptype, data, rows, in_features, part_bias))
                row += rows
            self.mat = lib.stack_mats(mats)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = lib.gemm(
            self.mat, x.reshape(-1, self.in_features).float(), torch.get_num_threads(), self.nrc
        )
        return y.view(*lead, self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        types = "+".join(lib.type_name(t) for t, _, _ in self.parts)
        return (
            f"in={self.in_features}, out={self.out_features}, {types}, bias={self.bias is not None}"
        )


class QuantEmbedding(nn.Module):
    """Token embedding over a table kept in its stored block type (GGML row-major rows, e.g. a
    view of the model file): looked-up rows are dequantized, the table never is."""

    def __init__(self, qtype: int, table: torch.Tensor, num_embeddings: int, dim: int):
        super().__init__()
        self.qtype, self.num_embeddings, self.embedding_dim = qtype, num_embeddings, dim
        if tuple(table.shape) != (num_embeddings, lib.row_bytes(qtype, dim)):
            raise ValueError(
                f"embedding table of shape {tuple(table.shape)} does not hold {num_embeddings} "
                f"rows of {dim} {lib.type_name(qtype)} weights"
            )
        self.table = table  # not a buffer: it may be a read-only view of the model file

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        rows = lib.dequantize_rows(self.table, self.qtype, self.embedding_dim, flat)
        return rows.view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {lib.type_name(self.qtype)}"


@dataclass
class QuantizeReport:
    qtype: str
    from_file: int = 0  # matrices whose blocks were taken from the GGUF file unchanged
    quantized: int = 0  # matrices quantized from float here
    bytes: int = 0  # size of all quantized matrices
    as_float: int = 0  # "stored" plan: matrices the file keeps in F16/F32/BF16 (float32 rows)
    # HF tensor names the quantized modules were built from (the float loader skips them)
    consumed: frozenset = frozenset()


def _raw_blocks(raw: dict, names: list[str], qtype: int) -> torch.Tensor | None:
    """The file's blocks for all of `names` stacked by rows, or None if any is missing/other type."""
    parts = []
    for name in names:
        entry = raw.get(name)
        if entry is None or int(entry[0]) != qtype:
            return None
        parts.append(np.asarray(entry[1]))
    return torch.from_numpy(np.ascontiguousarray(np.concatenate(parts, axis=0)))


def _swap(
    parent: nn.Module,
    attr: str,
    qtype: int,
    hf_names: list[str],
    raw: dict,
    nrc: int,
    report: QuantizeReport,
) -> None:
    linear: nn.Linear = getattr(parent, attr)
    rows, cols = linear.out_features, linear.in_features
    if cols % lib.BLOCK:
        raise ValueError(f"{attr}: {cols} input features is not a multiple of {lib.BLOCK}")
    blocks = _raw_blocks(raw, hf_names, qtype)
    if blocks is not None and tuple(blocks.shape) == (rows, lib.row_bytes(qtype, cols)):
        report.from_file += 1
    else:
        blocks = lib.quantize(linear.weight.detach(), qtype)
        report.quantized += 1
    threads = torch.get_num_threads()
    packed = lib.pack(blocks, qtype, rows, cols, threads, paired=attr == "gate_up_proj")
    bias = None if linear.bias is None else linear.bias.detach().float().contiguous()
    report.bytes += packed.numel()
    setattr(parent, attr, QuantLinear(qtype, packed, cols, rows, bias, nrc))


def quantize_model(
    model: nn.Module, qtype_name: str, raw: dict | None = None, nrc: int = 0
) -> QuantizeReport:
    """Swap the model's projections and LM head for QuantLinear modules (in place)."""
    if qtype_name not in lib.QTYPES:
        raise ValueError(
            f"quantization {qtype_name!r} is not supported; choose one of {', '.join(lib.QTYPES)}"
        )
    qtype, raw = lib.QTYPES[qtype_name], raw or {}
    report = QuantizeReport(qtype_name)
    for i, layer in enumerate(model.layers):
        for ours, theirs in _SOURCES.items():
            module_path, attr = ours.split(".")
            hf = [f"model.layers.{i}.{t}.weight" for t in theirs]
            _swap(getattr(layer, module_path), attr, qtype, hf, raw, nrc, report)
    head = ["model.embed_tokens.weight"] if model.config.tie_word_embeddings else ["lm_head.weight"]
    _swap(model, "lm_head", qtype, head, raw, nrc, report)
    log.info(
        "quantized to %s: %d matrices from the file, %d quantized here, %.1f MiB",
        qtype_name,
        report.from_file,
        report.quantized,
        report.bytes / 2**20,
    )
    return report
