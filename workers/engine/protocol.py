"""The one interface a worker drives an engine through. The model engine (engine.py), the
echo stand-in (workers/echo_engine.py) and engines for other runtimes implement it; the
worker never reaches into an engine's scheduler or cache."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Protocol, runtime_checkable

from syshax.shared.sampling import SamplingParams

from .outputs import EngineStats, StepOutput


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
