"""Per-request state inside one engine.

Torch-free on purpose (as nano-vllm keeps its scheduler and block manager): the bookkeeping
can be tested without a model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from syshax.shared.sampling import SamplingParams


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
    block_table: list[int] = field(default_factory=list)  # KV blocks, in position order
    block_keys: list = field(default_factory=list)  # prefix-cache keys of its full blocks
    # Rows before this are the prompt (with the outputs a resumed request brings); rows from
    # here on are decodes. For timings only.
    prefill_end: int = 0
    finish_reason: str | None = None
    detokenizer: Any = None  # IncrementalDetokenizer when the engine has a tokenizer
    constraint: Any = None  # structured-output matcher (constraints.py), built on first use
    # Speculative decoding (speculative.py): the running average of the share of its proposed
    # tokens the target accepted (None before its first verified proposal).
    acceptance: float | None = None
    ngram_draft: Any = None  # its last n-gram draft (ngram_lookup.OpenDraft), until settled
    ngram_cursor: Any = None  # where it last copied from (ngram_lookup.Cursor)
    # its ids as the n-gram lookup searches them (ngram_lookup.Haystack), appended to per step
    ngram_hay: Any = field(default=None, compare=False, repr=False)

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
