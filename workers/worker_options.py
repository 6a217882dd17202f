"""A worker's options and the jobs it holds (workers/worker.py runs them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from syshax.broker.liveness import HEARTBEAT_TTL
from syshax.broker.worker_io import Entry
from syshax.shared.sampling import SamplingParams


@dataclass
class Job:
    entry: Entry
    kind: str  # "prefill" | "decode"
    msg: Any  # PrefillJob | DecodeJob
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)  # delivered before this worker took it
    in_process: bool = False  # prefilled here and decoding here: no handoff

    @property
    def request_id(self) -> str:
        return self.msg.request_id


@dataclass
class WorkerOptions:
    worker_id: str
    roles: frozenset[str]
    device_class: str  # "xpu" (the xPU role, even when it runs on a CPU) | "cpu"
    device: str = "cpu"
    # The model name this worker serves: a job naming another is dead-lettered and fails,
    # and its engine's KV blobs carry it ("": jobs are not checked; tests' bare workers).
    served_model: str = ""
    kv_store: str = "auto"  # auto | shm | redis
    kv_ttl: float = 120.0
    output_ttl: int = 600
    heartbeat_s: float = 1.0
    heartbeat_ttl: float = HEARTBEAT_TTL  # silent this long = dead: others claim our jobs
    # Engine slots beyond the decode slots (an xPU worker with the prefill role, in a farm
    # that offloads decode): a prompt prefilled there while every decode slot is busy, for
    # the CPU to decode (Handoff.prefill_ahead). The engine has this many more sequences.
    handoff_slots: int = 0
    claim_s: float = 2.0
    sweep_s: float = 5.0
    block_ms: int = 100
