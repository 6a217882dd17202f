"""Per-request state inside one engine, and the pool of KV cache slots.

Torch-free on purpose (as nano-vllm keeps its scheduler and block manager): the bookkeeping
can be tested without a model.
"""

from __future__ import annotations

import heapq
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
    # Rows before this are the prompt (with the outputs a resumed request brings); rows from
    # here on are decodes. For timings only.
    prefill_end: int = 0
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


def make_detokenizer(tokenizer, seq: Sequence):
    """The sequence's incremental detokenizer (None without a tokenizer).

    A sequence that continues elsewhere (KV import, resume after a crash) replays the tokens
    generated so far, so the detokenizer holds what the first one held (half a UTF-8
    character, a possible stop-string prefix) and the text continues seamlessly.
    """
    if tokenizer is None:
        return None
    from syshax.shared.detokenizer import IncrementalDetokenizer

    det = IncrementalDetokenizer(tokenizer, stop=seq.params.stop, prompt_ids=seq.prompt_ids)
    for token_id in seq.output_ids:
        det.add(token_id)
    return det


def record_token(seq: Sequence, token: int, stop_ids: frozenset[int], max_model_len: int) -> str:
    """Append a sampled token and decide whether the sequence ends; return its new text.

    Ends with "stop" on a stop token (eos unless ignore_eos, or stop_token_ids; it adds no
    text) or a stop string, with "length" on max_tokens or max_model_len. On the last token
    the detokenizer's held-back text is released.
    """
    seq.output_ids.append(token)
    p = seq.params
    text = ""
    if (token in stop_ids and not p.ignore_eos) or token in p.stop_token_ids:
        seq.finish_reason = "stop"
    elif seq.detokenizer is not None:
        text = seq.detokenizer.add(token)
        if seq.detokenizer.stopped:
            seq.finish_reason = "stop"
    if seq.finish_reason is None and (
        (p.max_tokens is not None and len(seq.output_ids) >= p.max_tokens)
        or seq.length >= max_model_len
    ):
        seq.finish_reason = "length"
    if seq.finish_reason is not None and seq.detokenizer is not None:
        text += seq.detokenizer.flush()
    return text


class SlotPool:
    """KV cache slots, one per running sequence, handed out lowest first.

    A slot is a sequence's region of the cache for its whole life: nothing moves when another
    sequence leaves (the fused step and attention address rows by slot)."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots))  # a heap; lowest first keeps the used range small

    def __len__(self) -> int:
        """Slots in use."""
        return self.num_slots - len(self._free)

    @property
    def has_free(self) -> bool:
        return bool(self._free)

    def acquire(self, seq: Sequence) -> int:
        if not self._free:
            raise CapacityError(f"all {self.num_slots} sequence slots are in use")
        seq.slot = heapq.heappop(self._free)
        return seq.slot

    def release(self, seq: Sequence) -> None:
        if not 0 <= seq.slot < self.num_slots or seq.slot in self._free:
            raise KeyError(seq.request_id)
        heapq.heappush(self._free, seq.slot)
        seq.slot = -1
