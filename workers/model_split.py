"""How `syshax run` shares one host's cores between the models of a farm that serves several
(config `models:`).

The rule: each model's worker gets threads in proportion to the size of its weights on disk
(the model file, or the weight files of a model folder), at least one each. A CPU decode step
streams every weight once, so its time grows with that size: proportional threads give the
models about the same step time, instead of starving the larger one. The shares are rounded
by largest remainder so they sum to the cores; with fewer cores than models each gets one
thread (and they share cores).
"""

from __future__ import annotations

import math
from pathlib import Path

WEIGHT_SUFFIXES = (".gguf", ".safetensors", ".bin", ".pt")


def weights_bytes(path: Path) -> int:
    """Bytes of a model's weights: the file, or a folder's weight files; 0 if none is found
    (a missing model fails in its worker, with the worker's own message)."""
    try:
        if path.is_file():
            return path.stat().st_size
        if path.is_dir():
            return sum(
                f.stat().st_size
                for f in path.iterdir()
                if f.is_file() and f.suffix.lower() in WEIGHT_SUFFIXES
            )
    except OSError:
        pass
    return 0


def split_threads(sizes: list[int], cores: int) -> list[int]:
    """Threads per model, in the order of `sizes` (bytes of each one's weights): proportional
    to size, at least 1 each, summing to `cores` when cores >= the models (a size of 0 counts
    as the smallest known one, so an unknown size still gets its share)."""
    if not sizes:
        return []
    n = len(sizes)
    if cores <= n:
        return [1] * n
    known = [s for s in sizes if s > 0]
    sizes = [s if s > 0 else (min(known) if known else 1) for s in sizes]
    total = sum(sizes)
    shares = [cores * s / total for s in sizes]
    threads = [max(1, math.floor(x)) for x in shares]
    # Largest remainder: the cores left go to the models furthest below their share; cores
    # over (the minimum of 1 lifted a small model) come back from those furthest above it.
    while sum(threads) < cores:
        i = max(range(n), key=lambda k: (shares[k] - threads[k], -k))
        threads[i] += 1
    while sum(threads) > cores:
        i = max((k for k in range(n) if threads[k] > 1), key=lambda k: threads[k] - shares[k])
        threads[i] -= 1
    return threads
