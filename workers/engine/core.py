"""The one engine: a scheduler, a runner, and the request and KV API a worker drives.

nano-vllm's and vLLM v1's shape: `EngineCore.step()` = schedule (the torch-free `Scheduler`:
decode rows, then prompt chunks, within a token budget) -> execute (the runner: the token
sampled for each sequence the step reached the end of) -> update (detokenize, check stops,
free finished sequences' KV blocks). Engines differ only in their runner, swapped as those
projects swap the model runner:

* `ModelRunner` (model_runner.py): a loaded model, its paged KV cache and a forward, one
  native call per step on the CPU (`FusedRunner`) or PyTorch (`TorchRunner`, runner.py);
* `EchoRunner` (workers/echo_engine.py): no model, output token i is prompt token i;
* `EmulatedRunner` (workers/emulated_engine.py): the echo's tokens, each step slept for the
  time an accelerator profile predicts, KV blobs of the real model's shape.

`Engine` (engine.py), `EchoEngine` and `EmulatedEngine` are this class built with one of
them. The KV guards live here once: a sequence exports its KV only between steps with exactly
one row left (its last sampled token, the next decode's input); an import is checked by the
runner (the blob's model, then the request), admitted by the scheduler, filled by the runner,
and undone if filling fails. Torch-free: the echo stand-in runs without torch; runners bring
what they need.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any, Protocol

from syshax.shared.sampling import SamplingParams

from .errors import RequestError
from .kv_identity import KVIdentity
from .outputs import EngineStats, StepOutput
from .prompt_budget import typical_line
from .protocol import SchedulerRequests
from .scheduled_step import ScheduledStep
from .scheduler import Scheduler
from .sequence import Sequence


@dataclass
class Sampled:
    """Per chunk of step.sampling: the token, its logprob and the top logprobs (as (id,
    logprob) pairs, most likely first), None where the request did not ask."""

    tokens: list[int]
    logprobs: list[float | None]
    tops: list[list[tuple[int, float]] | None] | None = None
    # Tokens per chunk of step.sampling, when a chunk verified a draft (then the lists above
    # hold each chunk's tokens in order); None: one each.
    counts: list[int] | None = None


Blob = bytes | memoryview  # a KV blob: bytes, or a view of a lease's shared memory
Ids = Seq[int]


@dataclass
class ImportedKV:
    """A checked KV blob, ready to fill an admitted sequence's blocks: `num_tokens` cached
    positions and, for a runner that holds a cache, their keys and values."""

    num_tokens: int
    keys: Any = None
    values: Any = None


class Runner(Protocol):
    """What an engine swaps: it turns a scheduled step into sampled tokens and owns the KV.

    `timing` is what a step's recorded time (EngineStats) covers: "compute", the runner's
    `execute` alone (a model: what bench/cpu_decode.py and the worker's step-time model have
    always read), or "step", the whole step with scheduling and bookkeeping (the stand-ins,
    whose compute is nil or slept)."""

    kv_identity: KVIdentity
    timing: str

    @property
    def model_id(self) -> str:
        """The fingerprint of the model's shape that KV blobs carry."""

    def execute(self, step: ScheduledStep, started: float) -> Sampled:
        """The token (and logprob) of each chunk of `step.sampling`, in order. `started`:
        time.perf_counter() when the step began, before scheduling."""

    def finish(self, outputs: list[StepOutput]) -> None:
        """Called once the scheduler has recorded the step's tokens."""

    def export_kv(self, seq: Sequence) -> bytes:
        """`seq`'s KV as a blob: its `num_cached` positions, its last output the next token."""

    def read_kv(self, blob: Blob, prompt_ids: Ids, output_ids: Ids) -> ImportedKV:
        """The blob decoded and checked: another model's raises KVIdentityError, one that is
        not this request's (or is corrupt) KVFormatError."""

    def write_kv(self, seq: Sequence, kv: ImportedKV) -> None:
        """Fill `seq`'s blocks, just admitted, with the imported positions."""

    def describe_kv(self, blob: Blob) -> dict:
        """The blob's header fields, for the KV handle that records where it waits."""


class StandInRunner:
    """Defaults of the runners without a model (echo, emulated): the whole step is their time,
    nothing to do after a step, no cache to fill on import."""

    timing = "step"

    def finish(self, outputs: list[StepOutput]) -> None:
        return None

    def write_kv(self, seq: Sequence, kv: ImportedKV) -> None:
        return None


def echo_tokens(step: ScheduledStep) -> Sampled:
    """The stand-ins' tokens: output token i of a request is its prompt token i, cycling; no
    logprobs."""
    tokens = []
    for chunk in step.sampling:
        seq = chunk.seq
        tokens.append(seq.prompt_ids[len(seq.output_ids) % len(seq.prompt_ids)])
    return Sampled(tokens, [None] * len(tokens))


class EngineCore(SchedulerRequests):
    """A scheduler and a runner behind the engine protocol (protocol.py)."""

    def __init__(self, runner: Runner, scheduler: Scheduler, tokenizer=None) -> None:
        self.runner, self.scheduler, self.tokenizer = runner, scheduler, tokenizer
        self.max_model_len = scheduler.max_model_len
        self.stats = EngineStats()
        self.stats.spec = scheduler.spec_counts
        # The adaptive prompt budget's input: the line through this engine's step times.
        scheduler.step_model = lambda: typical_line(self.stats.steps.samples)

    @property
    def kv_identity(self) -> KVIdentity:
        return self.runner.kv_identity

    @property
    def model_id(self) -> str:
        return self.runner.model_id

    # ---- the loop -----------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        started = time.perf_counter()
        step = self.scheduler.schedule()
        if not step.chunks:
            return []
        decode_rows = step.decode_rows  # before the update moves the sequences on
        produced = self.stats.spec.decode_tokens
        computing = time.perf_counter()
        sampled = self.runner.execute(step, started)
        seconds = time.perf_counter() - computing
        outs = self.scheduler.update(
            step, sampled.tokens, sampled.logprobs, sampled.tops, sampled.counts
        )
        self.runner.finish(outs)
        if self.runner.timing == "step":
            seconds = time.perf_counter() - started
        produced = self.stats.spec.decode_tokens - produced
        # A draft model's steps ran while scheduling: the step's time includes them (what a
        # stream waits), the speculation policy's row prices do not (it prices them itself).
        drafter = self.scheduler.drafter
        spent = seconds + (drafter.last_seconds if drafter is not None else 0.0)
        self.stats.record(step.num_rows - decode_rows, decode_rows, max(spent, 1e-6), produced)
        self.scheduler.observe_step(step.num_rows - decode_rows, decode_rows, seconds)
        return outs

    def reset_prefix_cache(self) -> int:
        """Forget the cached prompt prefixes no running request holds; returns how many blocks
        (block_manager.py). A benchmark calls it between rounds, so a prompt seen in an
        earlier round is computed again rather than found."""
        return self.scheduler.blocks.reset_prefix_cache()

    def generate(
        self, prompt_ids: Seq[int], params: SamplingParams, request_id: str = "gen"
    ) -> Iterator[StepOutput]:
        """Run one request to the end, yielding each token (other requests keep running too)."""
        self.add_request(request_id, prompt_ids, params)
        while True:
            for out in self.step():
                if out.request_id == request_id:
                    yield out
                    if out.finished:
                        return

    # ---- KV movement --------------------------------------------------------------------

    def export_kv(self, request_id: str, release: bool = True) -> bytes:
        """The request's KV cache as a portable blob; `release` frees it here (the usual
        handoff). Only between steps, with the last sampled token not yet computed."""
        seq = self.scheduler.sequences.get(request_id)
        if seq is None or not seq.block_table or seq.length - seq.num_cached != 1:
            raise RequestError(f"request {request_id!r} has no KV cache in this engine")
        blob = self.runner.export_kv(seq)
        if release:
            self.abort(request_id)
        return blob

    def import_kv(
        self, request_id: str, blob: Blob, prompt_ids: Ids, output_ids: Ids, params: SamplingParams
    ) -> None:
        """Continue a request from a blob made by `export_kv` (any process, device or dtype)."""
        kv = self.runner.read_kv(blob, prompt_ids, output_ids)
        seq = self.scheduler.new_sequence(request_id, prompt_ids, params, output_ids)
        self.scheduler.add_running(seq, kv.num_tokens)
        try:
            self.runner.write_kv(seq, kv)
        except Exception:
            self.scheduler.abort(request_id)  # never keep blocks whose cache was not filled
            raise

    def describe_kv(self, blob: Blob) -> dict:
        return self.runner.describe_kv(blob)
