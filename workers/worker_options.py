"""A worker's options and the jobs it holds (workers/worker.py runs them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from syshax.broker.liveness import HEARTBEAT_TTL
from syshax.broker.worker_io import Entry
from syshax.shared.sampling import SamplingParams


@dataclass
class Claim:
    """A stream entry held by the jobs made from it (the choices of a prefill job, or the one
    decode job): acked (or dead-lettered) when the last of them lets go of it."""

    entry: Entry
    holders: set[str]  # the ids of the jobs still holding it
    part_stored: bool = False  # the request's part is in Redis (stored by a handoff of ours)
    dead_reason: str = ""  # a job asked for the entry to go to the dead letters

    def let_go(self, request_id: str) -> bool:
        """Release one job's hold; True when it was the last (the entry is now to be acked)."""
        if request_id not in self.holders:
            return False
        self.holders.discard(request_id)
        return not self.holders

    def is_last(self, request_id: str) -> bool:
        return self.holders == {request_id}


@dataclass
class Job:
    claim: Claim
    kind: str  # "prefill" | "decode"
    msg: Any  # PrefillJob | DecodeJob (a decode job with its request's part filled in)
    params: SamplingParams  # this choice's
    request_id: str  # this choice's id (schemas.choice_ids): its engine sequence, its tokens
    choice: int = 0
    output_ids: list[int] = field(default_factory=list)  # delivered before this worker took it
    in_process: bool = False  # prefilled here and decoding here: no handoff

    @property
    def entry(self) -> Entry:
        return self.claim.entry


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
    jobs: str = "redis"  # broker.jobs: where the job queues live (redis | amqp)
    amqp_url: str = ""  # broker.amqp_url ("": RabbitMQ's default local URL)
