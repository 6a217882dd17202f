"""Per-request state inside one engine, and the slot table that keeps running sequences packed.

Torch-free on purpose (as nano-vllm keeps its scheduler and block manager): the bookkeeping
can be tested without a model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from syshax.shared.sampling import SamplingParams

from .errors import CapacityError


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    # Tokens whose K/V are in the cache. Invariant while running: num_cached == len(all_ids) - 1
    # (the last sampled token is the next decode input and has no K/V yet).
    num_cached: int = 0
    slot: int = -1
    finish_reason: str | None = None
    detokenizer: Any = None  # IncrementalDetokenizer when the engine has a tokenizer

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SlotTable:
    """Running sequences by cache slot, always packed into slots [0, n).

    When a sequence leaves from the middle, the last one takes its slot; the caller moves that
    sequence's K/V (a copy of one sequence, instead of gathering the whole batch every step).
    """

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.running: list[Sequence] = []

    def __len__(self) -> int:
        return len(self.running)

    @property
    def has_free(self) -> bool:
        return len(self.running) < self.num_slots

    def add(self, seq: Sequence) -> int:
        if not self.has_free:
            raise CapacityError(f"all {self.num_slots} sequence slots are in use")
        seq.slot = len(self.running)
        self.running.append(seq)
        return seq.slot

    def remove(self, seq: Sequence) -> tuple[int, int, int] | None:
        """Free `seq`'s slot. Returns (src, dst, length) when the cache must move a sequence."""
        hole = seq.slot
        if hole < 0 or hole >= len(self.running) or self.running[hole] is not seq:
            raise KeyError(seq.request_id)
        last = self.running.pop()
        seq.slot = -1
        if last is seq:
            return None
        self.running[hole] = last
        src = last.slot
        last.slot = hole
        return src, hole, last.num_cached
