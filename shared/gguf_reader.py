"""A fast, torch-free reader of GGUF files' metadata and tensor infos.

The gateway needs a GGUF's tokenizer metadata at start-up. `gguf.GGUFReader` parses every array
element into its own numpy view and takes seconds on a 49k-token vocabulary; reading just the
key/value section with `struct` takes tens of milliseconds and touches no tensor data.
`read_gguf_info` also reads the tensor infos (names, shapes, types, offsets), so a weight loader
can map each tensor's bytes itself.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GGUF_MAGIC = b"GGUF"


class GGUFError(ValueError):
    """A file is not a GGUF file we can read (bad magic, unsupported version, truncated, or
    metadata beyond our bounds: arrays nested too deep, item counts larger than the file)."""


# GGUF metadata value types (gguf spec): id -> (struct format, byte width) for fixed-size ones.
_SCALAR = {
    0: ("B", 1),  # uint8
    1: ("b", 1),  # int8
    2: ("H", 2),  # uint16
    3: ("h", 2),  # int16
    4: ("I", 4),  # uint32
    5: ("i", 4),  # int32
    6: ("f", 4),  # float32
    7: ("?", 1),  # bool
    10: ("Q", 8),  # uint64
    11: ("q", 8),  # int64
    12: ("d", 8),  # float64
}
_STRING, _ARRAY = 8, 9
# Arrays of arrays nest no deeper than this: real files use one level (a vocabulary, its
# scores), and a crafted file could otherwise nest thousands deep and recurse past Python's
# stack limit (a RecursionError, not a GGUFError).
MAX_ARRAY_NESTING = 8
# The fewest bytes one array item of each type takes: an item count claiming more items than
# the bytes left could hold is refused before anything is read or allocated.
_MIN_ITEM_BYTES = {**{t: w for t, (_, w) in _SCALAR.items()}, _STRING: 8, _ARRAY: 12}


class _Cursor:
    """Sequential little-endian reader over a buffer, with bounds checks that name the file."""

    def __init__(self, buf: Any, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def _need(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            raise GGUFError(f"{self.path}: GGUF metadata is truncated at byte {self.pos}")

    def unpack(self, fmt: str, width: int) -> Any:
        self._need(width)
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += width
        return value

    def string(self) -> str:
        n = self.unpack("Q", 8)
        self._need(n)
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        # Vocabularies are UTF-8; a stray invalid byte must not make the whole file unreadable.
        return raw.decode("utf-8", errors="replace")

    def _strings(self, count: int) -> list[str]:
        """An array of strings (a vocabulary, its merges: ~100k items): the loop of `string`
        with its lookups hoisted, 3-4x faster, same checks and result."""
        buf, pos, end, unpack = self.buf, self.pos, len(self.buf), struct.unpack_from
        out = []
        append = out.append
        for _ in range(count):
            if pos + 8 > end:
                self.pos = pos
                self._need(8)
            (n,) = unpack("<Q", buf, pos)
            pos += 8
            if pos + n > end:
                self.pos = pos
                self._need(n)
            append(bytes(buf[pos : pos + n]).decode("utf-8", errors="replace"))
            pos += n
        self.pos = pos
        return out

    def value(self, vtype: int, key: str, depth: int = 0) -> Any:
        """One value of type `vtype` (of metadata `key`, named in errors); `depth` counts the
        arrays it is nested in."""
        if vtype in _SCALAR:
            return self.unpack(*_SCALAR[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            if depth >= MAX_ARRAY_NESTING:
                raise GGUFError(
                    f"{self.path}: GGUF metadata {key!r} nests arrays deeper than "
                    f"{MAX_ARRAY_NESTING} levels (at byte {self.pos})"
                )
            itype = self.unpack("I", 4)
            count = self.unpack("Q", 8)
            left = len(self.buf) - self.pos
            if itype in _MIN_ITEM_BYTES and count * _MIN_ITEM_BYTES[itype] > left:
                raise GGUFError(
                    f"{self.path}: GGUF metadata {key!r} claims {count} array items but only "
                    f"{left} bytes are left in the file (at byte {self.pos})"
                )
            if itype in _SCALAR:
                # One struct call for the whole array: token_type and scores are vocab-sized.
                fmt, width = _SCALAR[itype]
                self._need(count * width)
                items = struct.unpack_from(f"<{count}{fmt}", self.buf, self.pos)
                self.pos += count * width
                return list(items)
            if itype == _STRING:
                return self._strings(count)
            return [self.value(itype, key, depth + 1) for _ in range(count)]
        raise GGUFError(f"{self.path}: unknown GGUF metadata value type {vtype} at byte {self.pos}")


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor-info entry of a GGUF file, as stored (nothing is checked against the data)."""

    name: str
    dims: tuple[int, ...]  # innermost (contiguous) dimension first, as GGUF lists them
    ggml_type: int  # a ggml_type id (gguf.GGMLQuantizationType), not checked here
    offset: int  # of the tensor's first byte, relative to GGUFInfo.data_offset


@dataclass(frozen=True)
class GGUFInfo:
    """Everything of a GGUF file but its tensor data."""

    version: int
    metadata: dict[str, Any]  # as `read_gguf_metadata` returns it
    # key -> GGUF value type ids: (type,) for a scalar, (ARRAY, item type) for an array; e.g. to
    # tell a float32 value (6) from a float64 (12), which both read as a Python float.
    value_types: dict[str, tuple[int, ...]]
    tensors: list[GGUFTensorInfo]
    alignment: int  # general.alignment, 32 by default
    data_offset: int  # absolute file offset of the tensor data section (aligned)
    file_size: int


DEFAULT_ALIGNMENT = 32


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """All key/value metadata of a GGUF file (v2/v3), as plain Python values (possibly
    shared with other callers: read it, never modify it).

    Tensor infos and data are not read. Raises FileNotFoundError or GGUFError.
    """
    path = Path(path)
    key = _file_key(path)
    if _LAST is not None and _LAST[0] == key:
        return _LAST[1].metadata
    return _read(path, with_tensors=False).metadata


# The last header read with its tensor infos, kept: a model load reads it twice (the weight
# loader, then the tokenizer), and parsing a vocabulary and its merges (~100k strings) takes
# ~0.1 s each time.
_LAST: tuple[tuple, GGUFInfo] | None = None


def _file_key(path: Path) -> tuple:
    st = path.stat()
    return (str(path.resolve()), st.st_size, st.st_mtime_ns)


def read_gguf_info(path: str | Path) -> GGUFInfo:
    """Metadata, metadata value types, tensor infos and the data start of a GGUF file (v2/v3).

    Tensor data is not read (nor checked against the file size: that takes the ggml type sizes,
    which the weight loader has). The last file's result is reused while its size and
    modification time are unchanged: it is shared, so callers only read it. Raises
    FileNotFoundError or GGUFError.
    """
    global _LAST
    path = Path(path)
    key = _file_key(path)
    if _LAST is not None and _LAST[0] == key:
        return _LAST[1]
    info = _read(path, with_tensors=True)
    _LAST = (key, info)
    return info


def _read(path: Path, with_tensors: bool) -> GGUFInfo:
    with open(path, "rb") as fh:
        # mmap: a 100 MB-70 GB model file is never read beyond its metadata section.
        try:
            buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as exc:  # an empty file cannot be mapped
            raise GGUFError(f"{path}: not a GGUF file (empty)") from exc
    with buf:
        if buf[:4] != GGUF_MAGIC:
            raise GGUFError(f"{path}: not a GGUF file (magic {bytes(buf[:4])!r}, expected b'GGUF')")
        cur = _Cursor(buf, path)
        cur.pos = 4
        version = cur.unpack("I", 4)
        if version not in (2, 3):
            raise GGUFError(f"{path}: unsupported GGUF version {version} (supported: 2, 3)")
        tensor_count = cur.unpack("Q", 8)
        kv_count = cur.unpack("Q", 8)
        metadata: dict[str, Any] = {}
        value_types: dict[str, tuple[int, ...]] = {}
        for _ in range(kv_count):
            key = cur.string()
            vtype = cur.unpack("I", 4)
            if vtype == _ARRAY:
                cur._need(4)
                value_types[key] = (vtype, struct.unpack_from("<I", buf, cur.pos)[0])
            else:
                value_types[key] = (vtype,)
            metadata[key] = cur.value(vtype, key)
        if not with_tensors:
            return GGUFInfo(version, metadata, value_types, [], DEFAULT_ALIGNMENT, 0, len(buf))

        tensors = []
        names: set[str] = set()
        for _ in range(tensor_count):
            name = cur.string()
            if name in names:
                raise GGUFError(f"{path}: tensor {name!r} is listed twice")
            names.add(name)
            n_dims = cur.unpack("I", 4)
            cur._need(8 * n_dims)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, cur.pos)
            cur.pos += 8 * n_dims
            ggml_type = cur.unpack("I", 4)
            offset = cur.unpack("Q", 8)
            tensors.append(GGUFTensorInfo(name, dims, ggml_type, offset))

        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0:
            raise GGUFError(f"{path}: bad general.alignment {alignment!r}")
        data_offset = -(-cur.pos // alignment) * alignment
        return GGUFInfo(version, metadata, value_types, tensors, alignment, data_offset, len(buf))
