"""A zero-cost stand-in engine: the engine core and the real scheduler with the echo runner.

Output token i of a request is prompt token i (cycling), with real detokenized text when a
tokenizer is given. It lets the farm's own overhead (gateway, Redis, workers) be measured
and its paths (prefill -> KV handoff -> decode) be tested in seconds. Never for serving.
Torch-free: its KV blob is a small msgpack map of what the import checks, with no tensors.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq

import msgpack

from .engine.config import DEFAULT_MAX_MODEL_LEN
from .engine.core import EngineCore, ImportedKV, Sampled, StandInRunner, echo_tokens
from .engine.errors import KVFormatError
from .engine.kv_identity import KVIdentity
from .engine.outputs import StepOutput
from .engine.scheduled_step import ScheduledStep
from .engine.scheduler import Scheduler
from .engine.sequence import Sequence

ECHO_MODEL_ID = "echo-engine"
# No weights: the echo stand-in's blobs are told apart by the served name (and, in tests that
# need two "models", by a weights label of their choosing).
ECHO_WEIGHTS = "echo"


class EchoRunner(StandInRunner):
    model_id = ECHO_MODEL_ID

    def __init__(self, kv_identity: KVIdentity) -> None:
        self.kv_identity = kv_identity

    def execute(self, step: ScheduledStep, started: float) -> Sampled:
        return echo_tokens(step)

    def export_kv(self, seq: Sequence) -> bytes:
        return msgpack.packb(
            {
                "model_id": ECHO_MODEL_ID,
                "weights": self.kv_identity.weights,
                "served_model": self.kv_identity.served_model,
                "num_tokens": seq.length - 1,
                "next_token": seq.output_ids[-1],
            }
        )

    def read_kv(self, blob, prompt_ids: Seq[int], output_ids: Seq[int]) -> ImportedKV:
        meta = msgpack.unpackb(blob)
        if meta.get("model_id") != ECHO_MODEL_ID:
            raise KVFormatError("not an echo KV blob")
        self.kv_identity.check(meta.get("weights"), meta.get("served_model"))
        if meta["num_tokens"] != len(prompt_ids) + len(output_ids) - 1:
            raise KVFormatError("echo KV blob does not match the request")
        return ImportedKV(meta["num_tokens"])

    def describe_kv(self, blob) -> dict:
        return {**msgpack.unpackb(blob), "dtype": "none"}


class EchoEngine(EngineCore):
    def __init__(
        self,
        tokenizer=None,
        *,
        max_model_len: int = DEFAULT_MAX_MODEL_LEN,
        max_num_seqs: int = 16,
        step_delay: float = 0.0,
        max_num_batched_tokens: int | None = None,
        served_model: str = "",
        weights: str = ECHO_WEIGHTS,
    ):
        """`step_delay`: seconds each step sleeps first, to imitate a real engine's pace in
        tests (not counted in the step's recorded time)."""
        # No eos: the echo stand-in always generates exactly max_tokens.
        scheduler = Scheduler(
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
            tokenizer=tokenizer,
        )
        super().__init__(EchoRunner(KVIdentity(weights, served_model)), scheduler, tokenizer)
        self.step_delay = step_delay

    def step(self) -> list[StepOutput]:
        if self.step_delay:
            time.sleep(self.step_delay)
        return super().step()
