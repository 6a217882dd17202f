"""A short digest of a model's weights, computed in milliseconds, torch-free.

KV blobs carry it (workers/engine/kv_format.py): the model fingerprint covers only the shape
and the rope, so a base model and its fine-tune (same shape, other weights) would exchange KV
silently and produce wrong text. Hashing every weight of a multi-GB file takes seconds, so the
digest hashes what identifies the weights cheaply:

* a GGUF file: its tensor table (names, shapes, types, offsets) and SAMPLES blocks of BLOCK
  bytes evenly spaced over the tensor data, the first and the last included. The metadata
  (tokenizer, chat template, name) is left out: it does not change what the KV holds;
* a Hugging Face folder: each weights file's name and, for safetensors, its JSON header (tensor
  names, dtypes, shapes, offsets), plus sampled blocks of its data (SAMPLES blocks over the
  folder, shared by size, at least the first and last of each file). Weights other than
  safetensors (`*.bin`, `*.pt`, `*.pth`) are sampled as whole files; a folder with none of
  these, every file in it.

A fine-tune changes every tensor, so any sampled block tells it from its base; one changed
block elsewhere is caught with the probability that a sample covers it. About 256 KiB is read
whatever the model's size.

A folder written by `syshax convert` records its source GGUF's digest (LINEAGE_FILE), with the
digest of the folder's own weights as written: `weights_digest(folder)` returns the source's
while the folder's weights are still those, so vLLM on the folder and a CPU worker on the GGUF
exchange KV (docs/vllm.md). A folder whose weights changed since (a fine-tune saved over it)
gets its own digest.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from pathlib import Path

from .gguf_reader import GGUF_MAGIC, read_gguf_info

log = logging.getLogger(__name__)

BLOCK = 4096  # bytes per sampled block
SAMPLES = 64  # blocks per model (a GGUF's data section; a folder's files together)
DIGEST_CHARS = 16  # hex characters kept: 64 bits
LINEAGE_FILE = "syshax.json"  # a converted folder's record of its source
# A safetensors header larger than this is not one (the format caps it at 100 MB).
_MAX_SAFETENSORS_HEADER = 100_000_000
_OTHER_WEIGHTS = ("*.bin", "*.pt", "*.pth")


class DigestError(OSError):
    """A model path whose weights cannot be read (no such file, unreadable)."""


def weights_digest(path: str | os.PathLike) -> str:
    """The digest of a GGUF file's or an HF folder's weights (see the module docstring): the
    same for the same weights wherever they lie, different for other weights."""
    path = Path(path)
    if path.is_dir():
        own = folder_digest(path)
        lineage = read_lineage(path)
        if lineage is None:
            return own
        if lineage.get("folder_digest") == own and isinstance(lineage.get("weights_digest"), str):
            return lineage["weights_digest"]
        log.warning(
            "%s: its weights changed since it was converted from %s; using their own digest",
            path,
            lineage.get("source", "a GGUF"),
        )
        return own
    if not path.is_file():
        raise DigestError(f"{path}: no such model file or folder")
    h = _hasher("file")
    if _is_gguf(path):
        _hash_gguf(h, path)
    else:
        _sample(h, path, 0, path.stat().st_size, SAMPLES)
    return h.hexdigest()[:DIGEST_CHARS]


def folder_digest(folder: Path) -> str:
    """The digest of a folder's own weights files, ignoring any recorded lineage."""
    files = _weight_files(folder)
    regions = [(f, *_data_region(f)) for f in files]
    total = sum(max(end - start, 0) for _, start, end, _ in regions) or 1
    h = _hasher("folder")
    for f, start, end, header in regions:
        h.update(f.name.encode() + b"\0" + header + b"\0")
        # The folder's samples shared by size: a 10 GB shard gets more than a 1 MB one.
        count = max(2, round(SAMPLES * (end - start) / total))
        _sample(h, f, start, end, count)
    return h.hexdigest()[:DIGEST_CHARS]


def read_lineage(folder: Path) -> dict | None:
    """What a converted folder records about its source (None: no valid record)."""
    path = folder / LINEAGE_FILE
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        log.warning("%s: unreadable (%s); ignored", path, exc)
        return None
    return doc if isinstance(doc, dict) else None


def lineage_record(source: Path, folder: Path) -> dict:
    """The LINEAGE_FILE document for `folder` converted from the GGUF `source` (written by
    `syshax convert` once the folder's weights are complete)."""
    return {
        "weights_digest": weights_digest(source),
        "source": source.name,
        "folder_digest": folder_digest(folder),
    }


def sample_spans(start: int, end: int, count: int = SAMPLES) -> list[tuple[int, int]]:
    """(offset, length) of the blocks sampled from bytes [start, end): `count` blocks of BLOCK
    bytes evenly spaced, the first at `start` and the last ending at `end`; the whole range
    when it is no larger than those blocks together."""
    length = end - start
    if length <= 0:
        return []
    if count < 2 or length <= count * BLOCK:
        return [(start, length)]
    step = (length - BLOCK) / (count - 1)
    return [(start + round(i * step), BLOCK) for i in range(count)]


# ----------------------------------------------------------------------------- pieces


def _hasher(kind: str):
    # The kind keeps a file's digest apart from a folder's holding the same bytes.
    return hashlib.sha256(b"syshax-weights-v1\0" + kind.encode() + b"\0")


def _is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == GGUF_MAGIC
    except OSError as exc:
        raise DigestError(f"{path}: cannot read: {exc}") from exc


def _hash_gguf(h, path: Path) -> None:
    # The header is parsed once per file: the loader has just read it (read_gguf_info keeps
    # the last file's), so this costs the sampled reads only.
    info = read_gguf_info(path)
    table = [[t.name, list(t.dims), t.ggml_type, t.offset] for t in info.tensors]
    h.update(json.dumps([info.alignment, table], separators=(",", ":")).encode())
    _sample(h, path, info.data_offset, info.file_size, SAMPLES)


def _sample(h, path: Path, start: int, end: int, count: int) -> None:
    try:
        with open(path, "rb") as fh:
            for offset, length in sample_spans(start, end, count):
                block = os.pread(fh.fileno(), length, offset)
                # Offsets from the data's start: a longer header (metadata) moves the data.
                h.update(struct.pack("<QQ", offset - start, len(block)) + block)
    except OSError as exc:
        raise DigestError(f"{path}: cannot read: {exc}") from exc


def _weight_files(folder: Path) -> list[Path]:
    """The folder's weights: the shards its safetensors index lists, else its safetensors,
    else other weight files, else every file (each sorted by name)."""
    index = folder / "model.safetensors.index.json"
    try:
        names = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        files = sorted(folder / n for n in names if (folder / n).is_file())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        files = []  # no index (or not one): what the folder holds
    files = files or sorted(folder.glob("*.safetensors"))
    for pattern in _OTHER_WEIGHTS:
        files = files or sorted(folder.glob(pattern))
    files = files or sorted(p for p in folder.iterdir() if p.is_file() and p.name != LINEAGE_FILE)
    return [f for f in files if f.is_file()]


def _data_region(path: Path) -> tuple[int, int, bytes]:
    """(data start, data end, header bytes) of a weights file: a safetensors file's JSON
    header is hashed whole and its data sampled; any other file is all data."""
    size = path.stat().st_size
    if path.suffix != ".safetensors" or size < 8:
        return 0, size, b""
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        if n > min(size - 8, _MAX_SAFETENSORS_HEADER):
            return 0, size, b""  # not a valid header: the bytes as they are
        return 8 + n, size, fh.read(n)
