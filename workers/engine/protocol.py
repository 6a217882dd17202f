"""The one interface a worker drives an engine through. The engine core (core.py: the model
engine, the echo stand-in, the emulated accelerator) and engines for other runtimes (vLLM)
implement it; the worker never reaches into an engine's scheduler or cache."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Protocol, runtime_checkable

from syshax.shared.sampling import SamplingParams

from .outputs import EngineStats, StepOutput
from .scheduler import Scheduler


@runtime_checkable
class EngineProtocol(Protocol):
    max_model_len: int
    stats: EngineStats

    @property
    def num_slots(self) -> int:
        """Sequences the engine can run at once."""

    @property
    def num_running(self) -> int:
        """Sequences holding a slot (computing their prompt or decoding)."""

    @property
    def num_waiting(self) -> int:
        """Sequences queued for a slot."""

    @property
    def kv_blocks(self) -> tuple[int, int]:
        """(free, total) KV cache blocks: with nothing running, every block is free."""

    def request_ids(self) -> list[str]: ...

    def output_ids(self, request_id: str) -> list[int]: ...

    def add_request(
        self, request_id: str, prompt_ids: Seq[int], params: SamplingParams
    ) -> None: ...

    def resume_request(
        self, request_id: str, prompt_ids: Seq[int], output_ids: Seq[int], params: SamplingParams
    ) -> None: ...

    def abort(self, request_id: str) -> None: ...

    def has_unfinished(self) -> bool: ...

    def step(self) -> list[StepOutput]: ...

    def export_kv(self, request_id: str, release: bool = True) -> bytes: ...

    def describe_kv(self, blob: bytes | memoryview) -> dict: ...

    def import_kv(
        self,
        request_id: str,
        blob: bytes | memoryview,
        prompt_ids: Seq[int],
        output_ids: Seq[int],
        params: SamplingParams,
    ) -> None: ...


class SchedulerRequests:
    """The request side of the protocol for an engine built on `Scheduler` (the engine core,
    core.py): counts, ids, add / resume / abort. The engine sets `self.scheduler`."""

    scheduler: Scheduler

    @property
    def num_slots(self) -> int:
        return self.scheduler.max_num_seqs

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def kv_blocks(self) -> tuple[int, int]:
        """(free, total) KV blocks; free counts cached blocks nobody holds."""
        blocks = self.scheduler.blocks
        return blocks.num_free, blocks.num_blocks

    def request_ids(self) -> list[str]:
        return list(self.scheduler.sequences)

    def output_ids(self, request_id: str) -> list[int]:
        """The tokens generated so far for a request in this engine (KeyError if unknown)."""
        return list(self.scheduler.sequences[request_id].output_ids)

    def add_request(self, request_id: str, prompt_ids: Seq[int], params: SamplingParams) -> None:
        """Queue a request; `step()` computes its prompt when KV blocks and the token budget
        allow."""
        self.scheduler.add(self.scheduler.new_sequence(request_id, prompt_ids, params))

    def resume_request(
        self, request_id: str, prompt_ids: Seq[int], output_ids: Seq[int], params: SamplingParams
    ) -> None:
        """Continue a request whose KV is lost (its worker died): recompute it from the tokens."""
        self.scheduler.add(self.scheduler.new_sequence(request_id, prompt_ids, params, output_ids))

    def abort(self, request_id: str) -> None:
        """Drop a request wherever it is (waiting or running) and free its KV blocks."""
        self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()


class PortableKV:
    """`describe_kv` for the engines and runners whose blobs are kv_format's (the model's, the
    emulated accelerator's, vLLM's): the header's fields, for the KV handle that records where
    a blob waits. (kv_format is imported on use: this module stays torch-free.)"""

    def describe_kv(self, blob: bytes | memoryview) -> dict:
        from . import kv_format

        return kv_format.describe(blob)
