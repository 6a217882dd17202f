"""shared.gguf_reader.read_gguf_info: the struct-based GGUF header reader, checked against gguf's own."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFValueType
from syshax.shared.gguf_reader import (
    MAX_ARRAY_NESTING,
    GGUFError,
    read_gguf_info,
    read_gguf_metadata,
)


def _write(path: Path, alignment: int | None = None) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float64("llama.some_float64", 0.1)
    w.add_uint32("llama.block_count", 1)
    w.add_array("llama.head_counts", [4, 4])
    w.add_array("tokenizer.ggml.scores", [0.5, -1.25])
    w.add_token_list(["a", "b", "ü"])
    rng = np.random.default_rng(0)
    w.add_tensor("a.weight", rng.standard_normal((3, 5)).astype(np.float32))  # unaligned size
    w.add_tensor("b.weight", rng.standard_normal(7).astype(np.float16))
    q = gguf.quants.quantize(rng.standard_normal((2, 64)).astype(np.float32), 8)
    w.add_tensor("c.weight", q, raw_dtype=GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64, 8])
def test_tensor_infos_match_gguf_reader(tmp_path, alignment):
    path = _write(tmp_path / "t.gguf", alignment)
    info = read_gguf_info(path)
    ref = gguf.GGUFReader(path)

    assert info.version == 3 and info.file_size == path.stat().st_size
    assert info.alignment == (alignment or 32) and info.data_offset % info.alignment == 0
    assert info.metadata == read_gguf_metadata(path)
    assert info.metadata["tokenizer.ggml.tokens"] == ["a", "b", "ü"]
    assert info.value_types["llama.attention.layer_norm_rms_epsilon"] == (GGUFValueType.FLOAT32,)
    assert info.value_types["llama.some_float64"] == (GGUFValueType.FLOAT64,)
    assert info.value_types["tokenizer.ggml.scores"] == (
        GGUFValueType.ARRAY,
        GGUFValueType.FLOAT32,
    )
    assert info.value_types["tokenizer.ggml.tokens"] == (GGUFValueType.ARRAY, GGUFValueType.STRING)

    assert [t.name for t in info.tensors] == [t.name for t in ref.tensors]
    for ours, theirs in zip(info.tensors, ref.tensors, strict=True):
        assert ours.dims == tuple(int(d) for d in theirs.shape)
        assert ours.ggml_type == theirs.tensor_type
        assert info.data_offset + ours.offset == theirs.data_offset
    assert info.tensors[2].dims == (64, 2) and info.tensors[2].ggml_type == 8


def test_header_errors(tmp_path):
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(GGUFError, match="empty"):
        read_gguf_info(empty)
    good = _write(tmp_path / "t.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good[: good.index(b"c.weight") + 4])  # inside the tensor infos
    assert read_gguf_metadata(cut)["llama.block_count"] == 1  # metadata alone still reads
    with pytest.raises(GGUFError, match="truncated"):
        read_gguf_info(cut)
    with pytest.raises(FileNotFoundError):
        read_gguf_info(tmp_path / "missing.gguf")


def test_the_last_header_is_reused_until_the_file_changes(tmp_path):
    """A model load reads a header twice (weights, then tokenizer): the second read is the
    first one's result, and a rewritten file is read again."""
    path = _write(tmp_path / "m.gguf")
    info = read_gguf_info(path)
    assert read_gguf_info(path) is info
    assert read_gguf_metadata(path) is info.metadata
    _write(path, alignment=64)  # same metadata but the alignment: another size on disk
    again = read_gguf_info(path)
    assert again is not info and again.alignment == 64
    other = _write(tmp_path / "n.gguf")
    assert read_gguf_info(other) is not again


def _crafted(path: Path, key: str, value: bytes) -> Path:
    """A GGUF v3 file by hand: no tensors, one metadata key whose type+value bytes are given."""
    name = key.encode()
    path.write_bytes(b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, len(name)) + name + value)
    return path


def _nested_arrays(levels: int) -> bytes:
    """`levels` arrays, each holding the next one, the innermost holding the uint32 7."""
    value_type = struct.pack("<I", 9)  # ARRAY; each array then names its items' type
    array_of_one_array = struct.pack("<IQ", 9, 1)  # items ARRAY, 1 item
    innermost = struct.pack("<IQI", 4, 1, 7)  # items UINT32, 1 item: 7
    return value_type + array_of_one_array * (levels - 1) + innermost


def test_nesting_within_the_limit_reads(tmp_path):
    path = _crafted(tmp_path / "ok.gguf", "x.nested", _nested_arrays(MAX_ARRAY_NESTING))
    value = read_gguf_metadata(path)["x.nested"]
    for _ in range(MAX_ARRAY_NESTING):
        (value,) = value
    assert value == 7


def test_deeply_nested_arrays_are_a_gguf_error_not_a_recursion_error(tmp_path):
    """A crafted 60 KB header of arrays nested 5000 deep: before the bound it recursed past
    Python's stack limit (RecursionError, a traceback for whoever loads it)."""
    path = _crafted(tmp_path / "deep.gguf", "evil.nested", _nested_arrays(5000))
    assert path.stat().st_size > 60_000
    with pytest.raises(GGUFError, match=r"'evil.nested' nests arrays deeper than 8 levels"):
        read_gguf_metadata(path)
    just_over = _crafted(tmp_path / "nine.gguf", "k", _nested_arrays(MAX_ARRAY_NESTING + 1))
    with pytest.raises(GGUFError, match="nests arrays deeper"):
        read_gguf_info(just_over)


@pytest.mark.parametrize("item_type", [4, 8, 9])  # uint32, string, array
def test_array_counts_beyond_the_file_are_refused_before_reading(tmp_path, item_type):
    """An item count the bytes left cannot hold (2^60 here) fails at once, naming the key,
    instead of looping or allocating for items that are not there."""
    path = _crafted(tmp_path / "big.gguf", "big.array", struct.pack("<IIQ", 9, item_type, 2**60))
    with pytest.raises(GGUFError, match=r"'big.array' claims 1152921504606846976 array items"):
        read_gguf_metadata(path)
