"""The log-probabilities of a perplexity run's scored positions, saved for a later KL run.

A file holds, after a JSON header (context length, vocabulary, chunk count, a digest of the
token ids: a KL run must score the same tokens), every scored row's log-probabilities as
16-bit codes: row r stores `lo` and `step` (float32) and vocab uint16 codes, and entry j is
lo + code_j * step. `lo` is the row's smallest log-probability, raised to hi - RANGE
(hi: the largest) so one code step is RANGE / 65535 = 3.7e-4 nats: the KL divergence of a
Q8_0 model (about 0.005) is not blurred by the file's own rounding, and what is clamped has a
probability below e^-24 of the top one. Half the bytes of float32; llama-perplexity's
`--kl-divergence-base` stores its logits at the same width for the same reason.
Torch-free (numpy).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

MAGIC = b"SXLOGP1\n"
RANGE = 24.0  # nats below a row's top log-probability that are kept distinct
CODES = 65535


class LogitFileError(ValueError):
    """The file is not a saved run, or not one of this run's text and context length."""


@dataclass(frozen=True)
class RunShape:
    """What a KL run must share with the base run it reads."""

    n_ctx: int
    vocab: int
    n_chunks: int
    rows_per_chunk: int
    n_tokens: int
    tokens_sha256: str

    @classmethod
    def of(cls, tokens: list[int], n_ctx: int, vocab: int, n_chunks: int, rows: int) -> RunShape:
        digest = hashlib.sha256(np.asarray(tokens, dtype="<i4").tobytes()).hexdigest()
        return cls(n_ctx, vocab, n_chunks, rows, len(tokens), digest)


def encode_rows(logprobs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[rows, vocab] log-probabilities -> ([rows, 2] float32 lo and step, [rows, vocab]
    uint16 codes)."""
    lp = np.asarray(logprobs, dtype=np.float64)
    hi = lp.max(axis=1)
    lo = np.maximum(lp.min(axis=1), hi - RANGE)
    step = np.maximum((hi - lo) / CODES, 1e-12)
    codes = np.rint((np.clip(lp, lo[:, None], hi[:, None]) - lo[:, None]) / step[:, None])
    params = np.stack([lo, step], axis=1).astype(np.float32)
    return params, codes.astype(np.uint16)


def decode_rows(params: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """The stored rows as float64 log-probabilities, renormalised (so each row's
    probabilities sum to 1 after rounding and clamping)."""
    lp = params[:, :1].astype(np.float64) + codes * params[:, 1:].astype(np.float64)
    top = lp.max(axis=1, keepdims=True)
    return lp - (top + np.log(np.exp(lp - top).sum(axis=1, keepdims=True)))


class LogitWriter:
    """Writes a run's rows chunk by chunk; the file appears (renamed into place) on close."""

    def __init__(self, path: str | Path, shape: RunShape, model: str) -> None:
        self.path, self.shape = Path(path), shape
        self._tmp = self.path.with_name(self.path.name + ".part")
        header = json.dumps({**asdict(shape), "model": model}).encode()
        self._file = open(self._tmp, "wb")  # noqa: SIM115 - closed in close()
        self._file.write(MAGIC + struct.pack("<I", len(header)) + header)
        self._chunks = 0

    def write_chunk(self, logprobs: np.ndarray) -> None:
        if logprobs.shape != (self.shape.rows_per_chunk, self.shape.vocab):
            raise ValueError(f"chunk of shape {logprobs.shape}, expected rows x vocab")
        params, codes = encode_rows(logprobs)
        self._file.write(params.astype("<f4").tobytes() + codes.astype("<u2").tobytes())
        self._chunks += 1

    def close(self) -> None:
        self._file.close()
        if self._chunks != self.shape.n_chunks:
            self._tmp.unlink(missing_ok=True)
            raise ValueError(f"{self._chunks} of {self.shape.n_chunks} chunks written")
        os.replace(self._tmp, self.path)

    def abandon(self) -> None:
        self._file.close()
        self._tmp.unlink(missing_ok=True)


class LogitReader:
    """A saved run, read one chunk at a time (memory-mapped: the file can be GBs)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                head = f.read(len(MAGIC) + 4)
                if len(head) < len(MAGIC) + 4 or head[: len(MAGIC)] != MAGIC:
                    raise LogitFileError(f"{path}: not a file written by --save-logits")
                (size,) = struct.unpack("<I", head[len(MAGIC) :])
                meta = json.loads(f.read(size))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise LogitFileError(f"{path}: cannot read saved logits: {exc}") from exc
        self.model = meta.pop("model", "")
        self.shape = RunShape(**meta)
        rows, vocab = self.shape.rows_per_chunk, self.shape.vocab
        self._offset = len(MAGIC) + 4 + size
        self._chunk_bytes = rows * 8 + rows * vocab * 2
        expected = self._offset + self.shape.n_chunks * self._chunk_bytes
        if self.path.stat().st_size != expected:
            raise LogitFileError(
                f"{path}: truncated ({self.path.stat().st_size} of {expected} bytes)"
            )
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")

    def check(self, shape: RunShape) -> None:
        """Refuse a base run of other tokens, context length or vocabulary."""
        mine, theirs = asdict(shape), asdict(self.shape)
        wrong = [f"{k} {theirs[k]} (this run: {mine[k]})" for k in mine if mine[k] != theirs[k]]
        if wrong:
            raise LogitFileError(
                f"{self.path} was saved from another run: "
                + "; ".join(wrong)
                + " (use the same --text and --ctx, and a model with the same vocabulary)"
            )

    def chunk(self, index: int) -> np.ndarray:
        rows, vocab = self.shape.rows_per_chunk, self.shape.vocab
        start = self._offset + index * self._chunk_bytes
        params = np.frombuffer(self._map[start : start + rows * 8], dtype="<f4").reshape(rows, 2)
        body = self._map[start + rows * 8 : start + self._chunk_bytes]
        return decode_rows(params, np.frombuffer(body, dtype="<u2").reshape(rows, vocab))
