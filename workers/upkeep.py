"""A worker's work on timers, between engine steps: heartbeat (and the gauges it feeds), claims
of jobs nobody else will finish, and the KV lease sweep.

Claims, in the order a job can be lost:
- `take_back_own`: at start, entries still pending under this worker's id (an earlier process
  with the same id died, or Redis was lost): nobody else claims them while this id heartbeats.
- `take_back_lost`: on the claim timer, entries pending under this id that this process never
  received (Redis delivered them to a dead connection with our name after the take-back).
- orphans: entries pending under a consumer whose heartbeat is gone (XPENDING + XCLAIM).
- `rescue_stranded`: decode jobs on the other device class's stream while that class has no
  live decoder at all; a prefill worker that saw no live decoder of the right class (a late
  heartbeat, every one of them restarting) queued them where nobody reads.

A claim round takes stranded jobs, then orphans, into the worker's free slots. What it leaves
for want of room (`Upkeep.waiting`) comes before new work: the worker reads none while some
wait and claims again as soon as a slot is free (`claim_waiting`). Their clients are in the
middle of a stream; claimed only on the timer, into slots that new reads fill on every step,
they waited as long as new requests kept coming (a chaos run under load: 60 s and more).
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from syshax.broker.kv_store import KVStore
from syshax.broker.worker_io import Entry, Heartbeat, WorkQueues, decoder_classes

from .engine.outputs import EngineStats, TokenCadence
from .engine.protocol import EngineProtocol
from .farm_view import FarmView
from .metrics import WorkerMetrics
from .streams import Streams
from .worker_options import WorkerOptions

log = logging.getLogger(__name__)


# A worker whose streams came or went beats again this soon, not a whole heartbeat later: the
# dispatcher reads its slots from the heartbeat, and a CPU worker whose streams just ended
# looked full for up to a second (a third of a 128-token stream's life on 2 cores).
LOAD_BEAT_S = 0.05
# While others' jobs wait for room here, a worker with a free slot claims again at most this
# often (rather than a claim period later).
CLAIM_RETRY_S = 0.1


def step_fields(stats: EngineStats, cadence: TokenCadence) -> dict[str, float]:
    """The inter-token latency model and its tail in the heartbeat (ms; absent before the
    first decode step): what the dispatcher predicts from (`DeviceLoad`). The gaps between
    the worker's token events once it has a few, else the engine's step times."""
    cadenced = len(cadence.gaps) >= 8
    times = cadence.gaps if cadenced else stats.steps
    model = times.model(TokenCadence.GROWTH_FLOOR if cadenced else 0.0)
    if model is None:
        return {}
    return {
        "step_base_ms": round(model[0] * 1e3, 3),
        "step_row_ms": round(model[1] * 1e3, 4),
        "step_tail": round(times.tail(model), 3),
    }


def load_fields(
    e: EngineProtocol,
    opts: WorkerOptions,
    capacity: int,
    backlog: int,
    cadence: TokenCadence,
    draining: bool,
) -> dict[str, Any]:
    """A worker's heartbeat fields: its load now (`capacity`: its decode slots; `backlog`:
    decode jobs waiting for one)."""
    return {
        "roles": ",".join(sorted(opts.roles)),
        "device": opts.device,
        "device_class": opts.device_class,
        "capacity": capacity,
        "running": e.num_running,
        "waiting": e.num_waiting + backlog,
        "kv_blocks_held": e.kv_blocks[1] - e.kv_blocks[0],
        "kv_blocks": e.kv_blocks[1],
        "decode_tps": round(e.stats.recent_decode_tps, 2),
        # Speculative decoding so far (0 when off): drafts accepted, tokens per decode step.
        "spec_acceptance": round(e.stats.spec.acceptance_rate, 3),
        "spec_tokens_per_step": round(e.stats.spec.tokens_per_step, 2),
        **step_fields(e.stats, cadence),
        "model": opts.served_model,
        "draining": int(draining),
    }


def engine_name(engine: object) -> str:
    """The engine's kind as `--engine` names it (native, echo, emulated, vllm), for the
    heartbeat: the dashboard's Farm page shows which engine each worker runs."""
    return type(engine).__name__.removesuffix("Engine").lower() or "native"


class KeptWorker(Protocol):
    """The worker as its upkeep sees it (workers/worker.py's Worker): its load now, and where
    a claimed job goes."""

    draining: bool

    def load_fields(self) -> dict[str, Any]: ...

    def slots_held(self) -> int: ...

    def free_slots(self) -> int: ...

    def held_entries(self) -> set[tuple[str, str]]: ...

    def accept(self, entry: Entry) -> None: ...


class Upkeep:
    def __init__(
        self,
        worker: KeptWorker,
        engine: EngineProtocol,
        opts: WorkerOptions,
        *,
        streams: Streams,
        heartbeat: Heartbeat,
        kv: KVStore,
        farm: FarmView,
        metrics: WorkerMetrics,
    ):
        self.worker, self.engine, self.opts = worker, engine, opts
        self.streams, self.heartbeat, self.kv = streams, heartbeat, kv
        self.farm, self.metrics = farm, metrics
        self.due = {"heartbeat": 0.0, "claim": 0.0, "sweep": 0.0}  # monotonic times
        self.beaten_slots = 0  # slots_held() at the last heartbeat (LOAD_BEAT_S)
        self.prompt_tokens_seen = 0  # the engine's count at the last beat: the counter's base
        self.waiting = 0  # others' jobs the last claim round left for want of room
        self.claimed_at = 0.0  # monotonic time of the last claim round
        self.engine_name = engine_name(engine)

    def start(self) -> None:
        """Registered at once (before the first timer: peers and the dispatcher see this
        worker before its first step), then the jobs left pending under its id taken back."""
        self.heartbeat.beat(**self.worker.load_fields(), engine=self.engine_name)
        self.take_back_own()

    def stop(self) -> None:
        """Deregistered: nobody counts this worker's slots once it has drained."""
        self.heartbeat.remove()

    def on_timers(self, now: float, early: bool = False) -> None:
        """What is due at `now` (time.monotonic()): a heartbeat, a claim round, a KV sweep.

        `early`: the worker is about to run a step in which no stream decodes (prompts only:
        at one stream, the prefill between one request's last token and the next one's
        first). A claim round or KV sweep due within half its period runs now: in that step's
        time it delays no token of a running stream, while after it, it lands between the new
        stream's first token and its second (a loop trace at one stream, workers/loop_trace.py:
        that gap carried the handoff's decision, a load beat and whatever came due during the
        prefill, 4-5x the loop time of any other gap). The heartbeat is never early: that beat
        would carry the prompts about to be prefilled, and the dispatcher deciding their
        decode right after the step would read this worker as full and send every decode
        away (tests/commands/test_farm_page.py caught an xPU worker idle beside a CPU decode
        queue of 5). While streams decode, what is due waits up to half its period for such a
        step; a changed load is beaten as before."""
        due, opts, worker = self.due, self.opts, self.worker
        # While streams decode, a timer waits up to half its period more for such a step (a
        # heartbeat at most 1.5 s apart against a 10 s TTL; a claim round 1 s later).
        slack = -0.5 if early else 0.5 if self.engine.num_running else 0.0

        def due_now(timer: str, period: float) -> bool:
            return now >= due[timer] + slack * period

        # The heartbeat is never early: before a prompt-only step it would carry the prompts
        # about to be prefilled (see above); it is one round trip, the claim round seven.
        beat = now >= due["heartbeat"] + max(slack, 0.0) * opts.heartbeat_s
        if not beat and worker.slots_held() != self.beaten_slots:
            beat = now - due["heartbeat"] + opts.heartbeat_s >= LOAD_BEAT_S
        if beat:
            due["heartbeat"] = now + opts.heartbeat_s
            self.beat()
        if due_now("claim", opts.claim_s) and not worker.draining:
            self._claim_round(now)
        if due_now("sweep", opts.sweep_s):
            due["sweep"] = now + opts.sweep_s
            self.kv.sweep()

    def beat(self) -> None:
        """Heartbeat with the worker's load now, and the gauges that mirror it."""
        fields = self.worker.load_fields()
        self.heartbeat.beat(**fields, engine=self.engine_name)
        self.beaten_slots = fields["running"] + fields["waiting"]
        m, stats = self.metrics, self.engine.stats
        m.running.set(fields["running"])
        m.waiting.set(fields["waiting"])
        m.capacity.set(fields["capacity"])
        m.kv_usage.set(fields["kv_blocks_held"] / max(fields["kv_blocks"], 1))
        m.decode_tps.set(fields["decode_tps"])
        m.spec_acceptance.set(fields["spec_acceptance"])
        m.spec_tokens_per_step.set(fields["spec_tokens_per_step"])
        m.prompt_tokens.inc(stats.prompt_tokens - self.prompt_tokens_seen)
        self.prompt_tokens_seen = stats.prompt_tokens

    def claim_waiting(self, now: float) -> None:
        """A claim round at once when the last one left jobs for want of room and a slot is
        free now (at most every CLAIM_RETRY_S): the worker's schedule asks before new work."""
        worker = self.worker
        if not self.waiting or worker.draining or worker.free_slots() <= 0:
            return
        if now - self.claimed_at >= CLAIM_RETRY_S:
            self._claim_round(now)

    def _claim_round(self, now: float) -> None:
        self.due["claim"], self.claimed_at = now + self.opts.claim_s, now
        self.claim()

    def claim(self) -> None:
        """One claim round: stranded decode jobs, dead workers' jobs, ours Redis lost.

        Stranded jobs first: nobody has decoded them since their first token, while a dead
        worker's were decoding until it died. While workers keep dying, orphans are there on
        every round and would take all the room (a chaos run with every decoder dead at
        once for seconds left stranded streams waiting 71 s)."""
        worker = self.worker
        peers = self.farm.workers(force=True)
        live = {w["id"] for w in peers}
        waiting = self.rescue_stranded(peers, live)
        orphans = self.streams.idle.claim_orphans(live, worker.free_slots())
        for entry in orphans.entries:
            log.warning("claimed orphaned job %s from a dead worker", entry.entry_id)
            worker.accept(entry)
        self.waiting = waiting + orphans.left
        self.take_back_lost()

    def _own_queues(self) -> list[WorkQueues]:
        """Every stream this worker may hold entries of under its own id."""
        stranded = self.streams.stranded
        return [self.streams.idle] + ([stranded] if stranded is not None else [])

    def take_back_own(self) -> None:
        own = [entry for queue in self._own_queues() for entry in queue.own_pending()]
        for entry in own:
            log.warning("taking back job %s left pending under our id", entry.entry_id)
            self.worker.accept(entry)  # decode jobs wait in the backlog for a free slot

    def take_back_lost(self) -> None:
        """Entries pending under our id that this process never received: Redis handed them to
        a dead connection of ours (an earlier process with our id, or a connection the network
        cut) after `take_back_own` ran. Nobody else claims them while we heartbeat."""
        known = self.worker.held_entries()
        for queue in self._own_queues():
            for entry in queue.lost_own(known):
                log.warning(
                    "taking back job %s pending under our id but never received", entry.entry_id
                )
                self.worker.accept(entry)

    def rescue_stranded(self, peers: list[dict], live: set[str]) -> int:
        """Take the other class's decode jobs while it has no live decoder; the number left
        there for want of room."""
        worker, queue = self.worker, self.streams.stranded
        if queue is None or worker.draining or self.streams.other_class in decoder_classes(peers):
            return 0
        room = worker.free_slots()
        claim = queue.claim_orphans(live, room)
        entries = claim.entries + queue.read(room - len(claim.entries), None)
        for entry in entries:
            log.warning(
                "taking decode job %s stranded on %s (no live decoder there)",
                entry.entry_id,
                queue.streams[0],
            )
            worker.accept(entry)
        # Unread ones may be left only when the read had no room for more.
        full = len(entries) >= room
        return claim.left + (queue.unread() if full else 0)
