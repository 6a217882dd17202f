"""Perplexity and KL-divergence statistics over scored positions, as llama-perplexity reports
them. Torch-free (numpy): the rows come in as arrays from any model.

A scored row is the model's output at position i, predicting token i + 1. Perplexity is
exp(mean negative log-likelihood) with llama.cpp's error estimate: the standard error of the
mean NLL, sqrt(var / (n - 1)), carried through exp (PPL x that). Against a base run's rows:
the KL divergence KL(base || this) per row, whether the most likely token is the same, and
delta-p, this model's probability of the actual next token minus the base's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Rows of logits -> rows of log-probabilities (float64)."""
    x = np.asarray(logits, dtype=np.float64)
    top = x.max(axis=-1, keepdims=True)
    return x - (top + np.log(np.exp(x - top).sum(axis=-1, keepdims=True)))


def target_nll(logprobs: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Negative log-likelihood of each row's target token."""
    return -logprobs[np.arange(len(targets)), targets]


def mean_err(values: np.ndarray) -> tuple[float, float]:
    """The mean and its standard error sqrt(var / (n - 1)) (0 for one value)."""
    n = len(values)
    mean = float(values.mean())
    if n < 2:
        return mean, 0.0
    var = float((values * values).mean()) - mean * mean
    return mean, math.sqrt(max(var, 0.0) / (n - 1))


@dataclass
class Perplexity:
    """Accumulates the NLL of scored tokens."""

    nll: list[np.ndarray] = field(default_factory=list)

    def add(self, nll: np.ndarray) -> None:
        self.nll.append(np.asarray(nll, dtype=np.float64))

    @property
    def count(self) -> int:
        return sum(len(a) for a in self.nll)

    def value(self) -> tuple[float, float]:
        """(PPL, its error), llama.cpp's estimate."""
        mean, err = mean_err(np.concatenate(self.nll))
        ppl = math.exp(mean)
        return ppl, err * ppl


@dataclass
class KLRows:
    """Per-row comparison of this run against the base run."""

    kld: np.ndarray
    same_top: np.ndarray
    delta_p: np.ndarray
    delta_nll: np.ndarray  # this run's NLL minus the base's: ln(PPL / PPL base) on average


def compare_rows(base_lp: np.ndarray, lp: np.ndarray, targets: np.ndarray) -> KLRows:
    """`base_lp`, `lp`: [rows, vocab] log-probabilities of the base and this run."""
    base_p = np.exp(base_lp)
    kld = (base_p * (base_lp - lp)).sum(axis=1)
    rows = np.arange(len(targets))
    return KLRows(
        kld=kld,
        same_top=base_lp.argmax(axis=1) == lp.argmax(axis=1),
        delta_p=np.exp(lp[rows, targets]) - base_p[rows, targets],
        delta_nll=base_lp[rows, targets] - lp[rows, targets],
    )


@dataclass
class KLSummary:
    """What `llama-perplexity --kl-divergence` prints, the figures that compare runtimes."""

    count: int
    kld: float
    kld_err: float
    kld_median: float
    kld_p99: float
    kld_max: float
    same_top: float  # fraction
    same_top_err: float
    rms_dp: float  # probability (x100 for %)
    rms_dp_err: float
    mean_dp: float
    mean_dp_err: float
    ln_ppl_ratio: float
    ln_ppl_ratio_err: float


@dataclass
class KLDivergence:
    """Accumulates `compare_rows` over chunks."""

    parts: list[KLRows] = field(default_factory=list)

    def add(self, rows: KLRows) -> None:
        self.parts.append(rows)

    def _all(self, name: str) -> np.ndarray:
        return np.concatenate([getattr(p, name) for p in self.parts]).astype(np.float64)

    def summary(self) -> KLSummary:
        kld, dp = self._all("kld"), self._all("delta_p")
        n = len(kld)
        mean_kld, kld_err = mean_err(kld)
        same = float(self._all("same_top").mean())
        same_err = math.sqrt(same * (1 - same) / (n - 1)) if n > 1 else 0.0
        ms, ms_err = mean_err(dp * dp)
        rms = math.sqrt(ms)
        # error carried through the square root: d sqrt(x) = dx / (2 sqrt(x))
        rms_err = ms_err / (2 * rms) if rms > 0 else 0.0
        mean_dp, mean_dp_err = mean_err(dp)
        ratio, ratio_err = mean_err(self._all("delta_nll"))
        return KLSummary(
            count=n,
            kld=mean_kld,
            kld_err=kld_err,
            kld_median=float(np.median(kld)),
            kld_p99=float(np.percentile(kld, 99)),
            kld_max=float(kld.max()),
            same_top=same,
            same_top_err=same_err,
            rms_dp=rms,
            rms_dp_err=rms_err,
            mean_dp=mean_dp,
            mean_dp_err=mean_dp_err,
            ln_ppl_ratio=ratio,
            ln_ppl_ratio_err=ratio_err,
        )
