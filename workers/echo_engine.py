"""A zero-cost stand-in engine: the engine protocol and the real scheduler, no model.

Output token i of a request is prompt token i (cycling), with real detokenized text when a
tokenizer is given. It lets the farm's own overhead (gateway, Redis, workers) be measured
and its paths (prefill -> KV handoff -> decode) be tested in seconds. Never for serving.
"""

from __future__ import annotations

import time

import msgpack
from syshax.shared.sampling import SamplingParams

from .engine.errors import KVFormatError, RequestError
from .engine.kv_identity import KVIdentity
from .engine.outputs import EngineStats, StepOutput
from .engine.protocol import SchedulerRequests
from .engine.scheduler import DEFAULT_MAX_NUM_BATCHED_TOKENS, Scheduler

ECHO_MODEL_ID = "echo-engine"
# No weights: the echo stand-in's blobs are told apart by the served name (and, in tests that
# need two "models", by a weights label of their choosing).
ECHO_WEIGHTS = "echo"


class EchoEngine(SchedulerRequests):
    def __init__(
        self,
        tokenizer=None,
        *,
        max_model_len: int = 2048,
        max_num_seqs: int = 16,
        step_delay: float = 0.0,
        max_num_batched_tokens: int | None = None,
        served_model: str = "",
        weights: str = ECHO_WEIGHTS,
    ):
        self.tokenizer = tokenizer
        self.kv_identity = KVIdentity(weights, served_model)
        self.max_model_len = max_model_len
        self.step_delay = step_delay  # seconds per step, to imitate a real engine's pace in tests
        # No eos: the echo stand-in always generates exactly max_tokens.
        self.scheduler = Scheduler(
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens
            or max(DEFAULT_MAX_NUM_BATCHED_TOKENS, max_num_seqs),
            tokenizer=tokenizer,
        )
        self.stats = EngineStats()

    def export_kv(self, rid: str, release: bool = True) -> bytes:
        seq = self.scheduler.sequences.get(rid)
        if seq is None or not seq.block_table or seq.length - seq.num_cached != 1:
            raise RequestError(f"request {rid!r} has no KV cache in this engine")
        blob = msgpack.packb(
            {
                "model_id": ECHO_MODEL_ID,
                "weights": self.kv_identity.weights,
                "served_model": self.kv_identity.served_model,
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
        if meta.get("model_id") != ECHO_MODEL_ID:
            raise KVFormatError("not an echo KV blob")
        self.kv_identity.check(meta.get("weights"), meta.get("served_model"))
        if meta["num_tokens"] != len(prompt_ids) + len(output_ids) - 1:
            raise KVFormatError("echo KV blob does not match the request")
        seq = self.scheduler.new_sequence(rid, prompt_ids, params, output_ids)
        self.scheduler.add_running(seq, meta["num_tokens"])

    def step(self) -> list[StepOutput]:
        if self.step_delay:
            time.sleep(self.step_delay)
        start = time.perf_counter()
        step = self.scheduler.schedule()
        if not step.chunks:
            return []
        decode_rows = step.decode_rows
        tokens = []
        for chunk in step.sampling:
            seq = chunk.seq
            tokens.append(seq.prompt_ids[len(seq.output_ids) % len(seq.prompt_ids)])
        outs = self.scheduler.update(step, tokens, [None] * len(tokens))
        elapsed = max(time.perf_counter() - start, 1e-6)
        self.stats.record(step.num_rows - decode_rows, decode_rows, elapsed)
        return outs
