"""A zero-cost stand-in engine: same interface as `Engine`, no model.

Output token i of a request is prompt token i (cycling), with real detokenized text when a
tokenizer is given. It lets the farm's own overhead (gateway, Redis, workers) be measured
and its paths (prefill -> KV handoff -> decode) be tested in seconds. Never for serving.
"""

from __future__ import annotations

import time
from collections import deque

import msgpack
from syshax.shared.sampling import SamplingParams

from .engine.engine import EngineStats, StepOutput
from .engine.errors import KVFormatError, RequestError
from .engine.sequence import Sequence, SlotTable, make_detokenizer, record_token

ECHO_MODEL_ID = "echo-engine"


class EchoEngine:
    def __init__(
        self,
        tokenizer=None,
        *,
        max_model_len: int = 2048,
        max_num_seqs: int = 16,
        step_delay: float = 0.0,
    ):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.step_delay = step_delay  # seconds per step, to imitate a real engine's pace in tests
        self.slots = SlotTable(max_num_seqs)
        self.waiting: deque[Sequence] = deque()
        self.sequences: dict[str, Sequence] = {}
        self.stats = EngineStats()

    @property
    def num_running(self) -> int:
        return len(self.slots)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or len(self.slots))

    def _new(self, rid: str, prompt, output, params: SamplingParams) -> Sequence:
        if rid in self.sequences:
            raise RequestError(f"request {rid!r} is already in this engine")
        if not prompt or len(prompt) >= self.max_model_len:
            raise RequestError(
                f"prompt has {len(prompt)} tokens; max_model_len is {self.max_model_len}"
            )
        seq = Sequence(rid, list(prompt), params, output_ids=list(output))
        seq.detokenizer = make_detokenizer(self.tokenizer, seq)
        self.sequences[rid] = seq
        return seq

    def add_request(self, rid: str, prompt_ids, params: SamplingParams) -> None:
        self.waiting.append(self._new(rid, prompt_ids, [], params))

    def resume_request(self, rid: str, prompt_ids, output_ids, params: SamplingParams) -> None:
        self.waiting.append(self._new(rid, prompt_ids, output_ids, params))

    def abort(self, rid: str) -> None:
        seq = self.sequences.pop(rid, None)
        if seq is None:
            return
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif seq.slot >= 0:
            self.slots.remove(seq)

    def export_kv(self, rid: str, release: bool = True) -> bytes:
        seq = self.sequences[rid]
        blob = msgpack.packb(
            {
                "model_id": ECHO_MODEL_ID,
                "num_tokens": seq.length - 1,
                "next_token": seq.output_ids[-1],
            }
        )
        if release:
            self.abort(rid)
        return blob

    def describe_kv(self, blob: bytes) -> dict:
        return {**msgpack.unpackb(blob), "dtype": "none"}

    def import_kv(
        self, rid: str, blob: bytes, prompt_ids, output_ids, params: SamplingParams
    ) -> None:
        meta = msgpack.unpackb(blob)
        if (
            meta.get("model_id") != ECHO_MODEL_ID
            or meta["num_tokens"] != len(prompt_ids) + len(output_ids) - 1
        ):
            raise KVFormatError("echo KV blob does not match the request")
        seq = self._new(rid, prompt_ids, output_ids, params)
        self.slots.add(seq)

    def step(self) -> list[StepOutput]:
        if self.step_delay:
            time.sleep(self.step_delay)
        if self.waiting and self.slots.has_free:
            seq = self.waiting.popleft()
            self.slots.add(seq)
            self.stats.prompt_tokens += seq.length
            return [self._emit(seq)]
        start = time.perf_counter()
        outs = [self._emit(s) for s in list(self.slots.running)]
        if outs:
            elapsed = max(time.perf_counter() - start, 1e-6)
            self.stats.decode_tokens += len(outs)
            self.stats.decode_seconds += elapsed
            self.stats.recent.append((len(outs), elapsed))
        return outs

    def _emit(self, seq: Sequence) -> StepOutput:
        token = seq.prompt_ids[len(seq.output_ids) % len(seq.prompt_ids)]
        # No eos: the echo stand-in always generates exactly max_tokens.
        text = record_token(seq, token, frozenset(), self.max_model_len)
        if seq.finish_reason is not None:
            self.slots.remove(seq)
            self.sequences.pop(seq.request_id, None)
        return StepOutput(
            seq.request_id, token, text, None, len(seq.output_ids) - 1, seq.finish_reason
        )
