"""`syshax run`'s rule for a farm of several models: threads in proportion to each model's
weights on disk, at least one each, summing to the host's cores."""

from __future__ import annotations

from pathlib import Path

import pytest
from syshax.workers.model_split import split_threads, weights_bytes


@pytest.mark.parametrize(
    ("sizes", "cores", "threads"),
    [
        ([100, 100], 8, [4, 4]),
        ([300, 100], 8, [6, 2]),
        ([1000, 10], 8, [7, 1]),  # the small one keeps its one thread
        ([1000, 10, 10], 4, [2, 1, 1]),
        ([200, 100, 100], 5, [3, 1, 1]),  # largest remainder: 2.5 -> 3, the ties keep 1
        ([100, 100, 100], 2, [1, 1, 1]),  # fewer cores than models: one each, cores shared
        ([0, 100], 4, [2, 2]),  # an unknown size counts as the smallest known
        ([500], 16, [16]),
        ([], 4, []),
    ],
)
def test_split_threads(sizes, cores, threads) -> None:
    assert split_threads(sizes, cores) == threads


def test_split_always_sums_to_the_cores_with_one_each() -> None:
    for cores in range(1, 33):
        for sizes in ([1, 2, 3], [10**9, 1, 1, 1], [7, 7, 7, 7, 7], [5, 1000]):
            threads = split_threads(sizes, cores)
            assert min(threads) >= 1
            assert sum(threads) == max(cores, len(sizes))


def test_weights_bytes(tmp_path: Path) -> None:
    (tmp_path / "m.gguf").write_bytes(b"x" * 10)
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"x" * 7)
    (folder / "config.json").write_text("{}")  # not weights
    assert weights_bytes(tmp_path / "m.gguf") == 10
    assert weights_bytes(folder) == 7
    assert weights_bytes(tmp_path / "missing") == 0
