"""Sampling parameters of one request (torch-free: the gateway builds them, workers use them)."""

from __future__ import annotations

import secrets
from dataclasses import asdict, dataclass, field, replace
from typing import Any

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat


class SamplingError(ValueError):
    """A sampling parameter is out of range; `param` names it (OpenAI's error `param`)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    # Every request has a seed: drawn when none is given, so a sequence that moves between
    # workers keeps sampling the same tokens (see sampler.token_generator).
    seed: int = field(default_factory=lambda: secrets.randbits(63))
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False  # the chosen token's logprob
    top_logprobs: int = 0  # and this many of the most likely tokens' (0..20)
    # Logits processing (workers/engine/logits.py, vLLM's semantics and order).
    presence_penalty: float = 0.0  # -2..2
    frequency_penalty: float = 0.0  # -2..2
    repetition_penalty: float = 1.0  # > 0; 1 = off
    min_p: float = 0.0  # 0..1; 0 = off
    logit_bias: dict[str, float] = field(default_factory=dict)  # token id (text) -> -100..100
    # A structured-output constraint spec (shared/structured.py), None = free text. It travels
    # with the request, so a worker that takes over a sequence rebuilds the matcher.
    structured: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self) -> None:
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise SamplingError("max_tokens", f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            raise SamplingError(
                "temperature", f"temperature must be in [0, 2], got {self.temperature}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SamplingError("top_k", f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 <= self.seed < 2**63:
            raise SamplingError("seed", f"seed must be in [0, 2**63), got {self.seed}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise SamplingError(name, f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise SamplingError(
                "repetition_penalty",
                f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}",
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingError("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise SamplingError(
                "top_logprobs",
                f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {self.top_logprobs}",
            )
        for token, bias in self.logit_bias.items():
            if not (isinstance(token, str) and token.isdigit()):
                raise SamplingError("logit_bias", f"logit_bias keys are token ids, got {token!r}")
            if not -100.0 <= bias <= 100.0:
                raise SamplingError(
                    "logit_bias", f"logit_bias[{token}] must be in [-100, 100], got {bias}"
                )
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise SamplingError("stop", "stop must be a non-empty string or a list of them")

    def for_choice(self, index: int) -> SamplingParams:
        """Choice `index` of a request with these (choice 0's) parameters: its own seed, so
        the choices of a sampled request differ and each is reproducible on any worker."""
        if index == 0:
            return self
        return replace(self, seed=(self.seed + index) % 2**63)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        return cls(**d)
