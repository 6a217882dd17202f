"""shared.weights_digest: the same weights give the same digest wherever they lie; other
weights of the same shape (a fine-tune) give another; a multi-GB file costs a few hundred KiB
of reads; a converted folder's recorded lineage holds only while its weights are unchanged."""

from __future__ import annotations

import json
import os
import shutil
import struct
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.numpy import save_file
from syshax.shared import weights_digest as wd
from syshax.shared.gguf_reader import read_gguf_info
from syshax.shared.weights_digest import (
    BLOCK,
    LINEAGE_FILE,
    SAMPLES,
    DigestError,
    folder_digest,
    sample_spans,
    weights_digest,
)


def _gguf(path: Path, seed: int = 0, name: str = "tiny", rename: str | None = None) -> Path:
    """A GGUF of three tensors (~600 KiB of data: more than the samples cover) from `seed`."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(name)
    w.add_uint32("llama.block_count", 1)
    w.add_tensor(rename or "token_embd.weight", rng.standard_normal((512, 256)).astype(np.float32))
    w.add_tensor("blk.0.attn_q.weight", rng.standard_normal((64, 64)).astype(np.float32))
    w.add_tensor("output_norm.weight", rng.standard_normal(64).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0xFF]))


def test_sample_spans_cover_first_and_last_block_evenly():
    spans = sample_spans(1000, 1000 + 10 * 2**20)
    assert len(spans) == SAMPLES and all(n == BLOCK for _, n in spans)
    assert spans[0][0] == 1000 and spans[-1][0] + BLOCK == 1000 + 10 * 2**20
    gaps = {b[0] - a[0] for a, b in zip(spans, spans[1:], strict=False)}
    assert max(gaps) - min(gaps) <= 1  # evenly spaced (rounding)
    assert sample_spans(0, 5000) == [(0, 5000)]  # small: read whole
    assert sample_spans(10, 10) == []


def test_gguf_digest_is_stable_and_independent_of_path_and_metadata(tmp_path):
    a = _gguf(tmp_path / "a.gguf")
    digest = weights_digest(a)
    assert len(digest) == 16 and int(digest, 16) >= 0
    assert weights_digest(a) == digest
    copy = tmp_path / "elsewhere" / "renamed.gguf"
    copy.parent.mkdir()
    shutil.copyfile(a, copy)
    assert weights_digest(copy) == digest
    # The metadata (name, tokenizer, template) does not change what a KV cache holds.
    other = _gguf(tmp_path / "b.gguf", name="another name" * 50)
    assert read_gguf_info(other).data_offset != read_gguf_info(a).data_offset
    assert weights_digest(other) == digest


def test_same_shape_other_weights_give_another_digest(tmp_path):
    base = weights_digest(_gguf(tmp_path / "base.gguf", seed=0))
    tuned = _gguf(tmp_path / "tuned.gguf", seed=1)
    assert read_gguf_info(tuned).tensors == read_gguf_info(tmp_path / "base.gguf").tensors
    assert weights_digest(tuned) != base


@pytest.mark.parametrize("where", ["first", "last", "sampled"])
def test_one_changed_sampled_block_changes_the_digest(tmp_path, where):
    path = _gguf(tmp_path / "m.gguf")
    before = weights_digest(path)
    info = read_gguf_info(path)
    spans = sample_spans(info.data_offset, info.file_size)
    offset = {
        "first": info.data_offset,
        "last": info.file_size - 1,
        "sampled": spans[SAMPLES // 2][0] + 17,
    }[where]
    _flip(path, offset)
    assert weights_digest(path) != before


def test_tensor_table_is_part_of_the_digest(tmp_path):
    a = weights_digest(_gguf(tmp_path / "a.gguf"))
    assert weights_digest(_gguf(tmp_path / "b.gguf", rename="tok_embd.weight")) != a


def _count_reads(monkeypatch) -> list[int]:
    reads: list[int] = []
    real = os.pread

    def pread(fd: int, n: int, offset: int) -> bytes:
        reads.append(n)
        return real(fd, n, offset)

    monkeypatch.setattr(wd.os, "pread", pread)
    return reads


def test_a_multi_gb_gguf_costs_a_few_hundred_kib(tmp_path, monkeypatch):
    path = _gguf(tmp_path / "big.gguf")
    os.truncate(path, 8 * 2**30)  # sparse: a data section of 8 GiB, no disk used
    read_gguf_info(path)  # the loader's header read, which the digest reuses
    reads = _count_reads(monkeypatch)
    start = time.perf_counter()
    weights_digest(path)
    assert time.perf_counter() - start < 0.5
    assert len(reads) == SAMPLES and sum(reads) == SAMPLES * BLOCK  # 256 KiB


def _safetensors(folder: Path, seed: int, shards: int = 1) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(shards):
        name = "model.safetensors" if shards == 1 else f"model-{i + 1:05d}-of-{shards:05d}.safetensors"  # fmt: skip
        tensors = {f"layers.{i}.w": rng.standard_normal((256, 256)).astype(np.float32)}
        save_file(tensors, str(folder / name))
    (folder / "config.json").write_text("{}")
    return folder


def test_hf_folder_digest(tmp_path):
    a = weights_digest(_safetensors(tmp_path / "a", seed=0))
    assert weights_digest(_safetensors(tmp_path / "copy", seed=0)) == a
    assert weights_digest(_safetensors(tmp_path / "tuned", seed=1)) != a
    sharded = _safetensors(tmp_path / "sharded", seed=0, shards=3)
    two = weights_digest(sharded)
    assert two != a
    _flip(sharded / "model-00003-of-00003.safetensors", (sharded / "model-00003-of-00003.safetensors").stat().st_size - 1)  # fmt: skip
    assert weights_digest(sharded) != two
    # A file's digest is not its folder's, even with the same bytes.
    assert weights_digest(tmp_path / "a" / "model.safetensors") != a


def test_a_multi_gb_safetensors_folder_costs_a_few_hundred_kib(tmp_path, monkeypatch):
    folder = tmp_path / "big"
    folder.mkdir()
    header = json.dumps({"w": {"dtype": "F32", "shape": [2**30], "data_offsets": [0, 2**32]}})
    path = folder / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header.encode())
    os.truncate(path, 8 + len(header) + 2**32)  # sparse 4 GiB of data
    reads = _count_reads(monkeypatch)
    start = time.perf_counter()
    weights_digest(folder)
    assert time.perf_counter() - start < 0.5
    assert sum(reads) <= (SAMPLES + 2) * BLOCK


def test_other_weight_files_and_bare_folders(tmp_path):
    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "pytorch_model.bin").write_bytes(os.urandom(100_000))
    (folder / "config.json").write_text("{}")
    digest = weights_digest(folder)
    (folder / "config.json").write_text('{"changed": 1}')  # not a weight file
    assert weights_digest(folder) == digest
    _flip(folder / "pytorch_model.bin", 0)
    assert weights_digest(folder) != digest
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "weights.npy").write_bytes(b"x" * 100)
    assert weights_digest(bare) != weights_digest(tmp_path / "bin")
    with pytest.raises(DigestError, match="no such"):
        weights_digest(tmp_path / "missing.gguf")


def test_recorded_lineage_holds_while_the_weights_are_those(tmp_path):
    source = weights_digest(_gguf(tmp_path / "src.gguf"))
    folder = _safetensors(tmp_path / "converted", seed=0)
    own = folder_digest(folder)
    record = {"weights_digest": source, "source": "src.gguf", "folder_digest": own}
    (folder / LINEAGE_FILE).write_text(json.dumps(record))
    assert weights_digest(folder) == source
    # A fine-tune saved over the folder: its own digest, not the source's.
    _safetensors(folder, seed=1)
    assert weights_digest(folder) == folder_digest(folder) != source
    (folder / LINEAGE_FILE).write_text("not json")
    assert weights_digest(folder) == folder_digest(folder)
