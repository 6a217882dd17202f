"""Sampling parameters of one request (torch-free: the gateway builds them, workers use them)."""

from __future__ import annotations

import secrets
from dataclasses import asdict, dataclass, field
from typing import Any


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
    logprobs: bool = False

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
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise SamplingError("stop", "stop must be a non-empty string or a list of them")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        return cls(**d)
