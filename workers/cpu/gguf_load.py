"""Build a GGUF model's projections and embedding straight from the file's blocks.

Called by the engine's loader while a GGUF loads for the CPU kernels (`weights=` "stored",
"q4_0" or "q8_0", see `workers/engine/loader.py`). Each matrix is read from the file's memory
map, packed into the kernels' tiles, and its file pages released before the next one is read:
the model's resident size is its packed size (about the file's), never a float copy.
"""

from __future__ import annotations

import logging
import sys
import warnings

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from syshax.shared import env
from tqdm import tqdm

from . import lib
from .quantized import _SOURCES, QuantEmbedding, QuantizeReport, QuantLinear

log = logging.getLogger(__name__)

_FLOAT_TYPES = frozenset({T.F32, T.F16, T.BF16})


def _tensor(arr: np.ndarray) -> torch.Tensor:
    """A torch view of a (possibly read-only, file-mapped) array: the kernels only read it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "the given NumPy array is not writable"
        return torch.from_numpy(np.ascontiguousarray(arr))


def _source(gg, name: str, plan: str) -> tuple[int, torch.Tensor, str]:
    """(kernel type, GGML row-major blocks [rows, bytes] or float32 rows [rows, cols], how:
    "stored" | "float" | "quantized")."""
    ttype = gg.tensors[name].tensor_type
    target = lib.QTYPES.get(plan)  # None for "stored"
    if (target is None and int(ttype) in lib.NATIVE_TYPES) or int(ttype) == target:
        qtype, blocks = gg.blocks(name)
        return int(qtype), _tensor(blocks), "stored"
    if target is None and ttype in _FLOAT_TYPES:
        return lib.F32, gg.float(name, torch.float32).contiguous(), "float"
    if target is None:
        # A block type the kernels do not run (Q5_0, Q2_K, IQ*, ...): Q8_0 keeps it close.
        log.warning("%s: %s is not a native kernel type; requantized to q8_0", name, ttype.name)
        target = lib.Q8_0
    return target, lib.quantize(gg.float(name, torch.float32), target), "quantized"


def _linear(parts: list[tuple[int, torch.Tensor]], cols: int, bias, nrc: int) -> QuantLinear:
    """One QuantLinear from row parts (q/k/v, gate/up), packed straight into one buffer: no
    concatenated copy of the file's blocks. Parts of different types become a stack."""
    threads = torch.get_num_threads()
    rows = [int(d.shape[0]) for _, d in parts]
    types = [q for q, _ in parts]
    sizes = [
        d.numel() * d.element_size() if q == lib.F32 else lib.packed_bytes(q, r, cols)
        for (q, d), r in zip(parts, rows, strict=True)
    ]
    offsets = [sum(sizes[:i]) for i in range(len(parts))]
    eager = env.huge_pages() == "eager"  # advised before the pack (weight_buffer) or after
    buf = lib.weight_buffer(sum(sizes), eager=eager)
    for (qtype, data), r, off, size in zip(parts, rows, offsets, sizes, strict=True):
        dest = buf[off : off + size]
        if qtype == lib.F32:
            dest.copy_(data.reshape(-1).view(torch.uint8))
        else:
            # Each part in its own thread split (for gate and up that is the paired split the
            # fused step computes them in: first touch puts rows where they are read).
            lib.pack(data, qtype, r, cols, threads, out=dest)
    if not eager:
        lib.advise_huge_pages(buf)  # now that it is filled: khugepaged collapses it later
    if len(set(types)) == 1 and all(r % 8 == 0 for r in rows[:-1]):
        weights = buf.view(torch.float32) if types[0] == lib.F32 else buf
        return QuantLinear(types[0], weights, cols, sum(rows), bias, nrc)
    layout = [(q, r, off) for q, r, off in zip(types, rows, offsets, strict=True)]
    return QuantLinear(-1, buf, cols, sum(rows), bias, nrc, parts=layout)


def _bias(gg, stems: list[str], rows: list[int]) -> torch.Tensor | None:
    names = [f"{s}.bias" for s in stems]
    if not any(n in gg for n in names):
        return None
    return torch.cat(
        [gg.float(n) if n in gg else torch.zeros(r) for n, r in zip(names, rows, strict=True)]
    ).contiguous()


def load_gguf_projections(
    net, gg, plan: str, nrc: int = 0, progress: bool = True
) -> QuantizeReport:
    """Replace `net`'s projections and LM head by QuantLinear and its token embedding by a
    QuantEmbedding where the file's type allows (in place, on a meta-device model); returns the
    report, whose `consumed` names the tensors the float loader must skip."""
    report = QuantizeReport(plan)
    jobs = []
    for i, layer in enumerate(net.layers):
        for ours, theirs in _SOURCES.items():
            module_path, attr = ours.split(".")
            jobs.append((getattr(layer, module_path), attr, [f"model.layers.{i}.{t}" for t in theirs]))  # fmt: skip
    untied = "lm_head.weight" in gg and not net.config.tie_word_embeddings
    jobs.append((net, "lm_head", ["lm_head" if untied else "model.embed_tokens"]))
    consumed: set[str] = set()
    bar = tqdm(jobs, desc=f"loading {gg.path.name}", unit="matrix", file=sys.stderr, disable=not progress)  # fmt: skip
    for parent, attr, stems in bar:
        names = [f"{s}.weight" for s in stems]
        cols = getattr(parent, attr).in_features
        sources = [_source(gg, n, plan) for n in names]
        parts = [(qtype, data) for qtype, data, _ in sources]
        how = {h for _, _, h in sources}
        if "quantized" in how:
            report.quantized += 1
        elif "float" in how:
            report.as_float += 1
        else:
            report.from_file += 1
        bias = _bias(gg, stems, [int(d.shape[0]) for _, d in parts])
        module = _linear(parts, cols, bias, nrc)
        report.bytes += module.blocks.numel() * module.blocks.element_size()
        setattr(parent, attr, module)
        for n in names:
            gg.release(n)
        consumed.update(names)
        consumed.update(f"{s}.bias" for s in stems if f"{s}.bias" in gg)
    embed = "model.embed_tokens.weight"
    etype = gg.tensors[embed].tensor_type
    if int(etype) in lib.EMBED_TYPES:
        qtype, table = gg.blocks(embed)
        c = net.config
        net.embed_tokens = QuantEmbedding(int(qtype), _tensor(table), c.vocab_size, c.hidden_size)
        gg.release(embed)  # rows come back from the file as they are looked up
        consumed.add(embed)
    report.consumed = frozenset(consumed)
    log.info(
        "weights %s: %d matrices as stored, %d as float32, %d requantized, %.1f MiB",
        plan,
        report.from_file,
        report.as_float,
        report.quantized,
        report.bytes / 2**20,
    )
    return report
