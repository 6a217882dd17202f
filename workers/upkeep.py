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
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from syshax.broker.worker_io import decoder_classes

if TYPE_CHECKING:
    from .worker import Worker

log = logging.getLogger(__name__)


# A worker whose streams came or went beats again this soon, not a whole heartbeat later: the
# dispatcher reads its slots from the heartbeat, and a CPU worker whose streams just ended
# looked full for up to a second (a third of a 128-token stream's life on 2 cores).
LOAD_BEAT_S = 0.05


def on_timers(worker: Worker, now: float) -> None:
    timers, opts = worker.timers, worker.opts
    due = now >= timers["heartbeat"]
    if not due and worker.slots_held() != worker.beaten_slots:
        due = now - timers["heartbeat"] + opts.heartbeat_s >= LOAD_BEAT_S
    if due:
        timers["heartbeat"] = now + opts.heartbeat_s
        _beat(worker)
    if now >= timers["claim"] and not worker.draining:
        timers["claim"] = now + opts.claim_s
        peers = worker.peers(force=True)
        live = {w["id"] for w in peers}
        for entry in worker.idle_queues.claim_orphans(live, worker.free_slots()):
            log.warning("claimed orphaned job %s from a dead worker", entry.entry_id)
            worker.accept(entry)
        take_back_lost(worker)
        rescue_stranded(worker, peers, live)
    if now >= timers["sweep"]:
        timers["sweep"] = now + opts.sweep_s
        worker.kv.sweep()


def _beat(worker: Worker) -> None:
    fields = worker.load_fields()
    worker.heartbeat.beat(**fields)
    worker.beaten_slots = fields["running"] + fields["waiting"]
    m, stats = worker.metrics, worker.engine.stats
    m.running.set(fields["running"])
    m.waiting.set(fields["waiting"])
    m.capacity.set(fields["capacity"])
    m.kv_usage.set(fields["kv_blocks_held"] / max(fields["kv_blocks"], 1))
    m.decode_tps.set(fields["decode_tps"])
    m.prompt_tokens.inc(stats.prompt_tokens - worker.prompt_tokens_seen)
    worker.prompt_tokens_seen = stats.prompt_tokens


def take_back_own(worker: Worker) -> None:
    own = worker.idle_queues.own_pending()
    if worker.stranded is not None:
        own += worker.stranded.own_pending()
    for entry in own:
        log.warning("taking back job %s left pending under our id", entry.entry_id)
        worker.accept(entry)  # decode jobs wait in the backlog for a free slot


def take_back_lost(worker: Worker) -> None:
    """Entries pending under our id that this process never received: Redis handed them to a
    dead connection of ours (an earlier process with our id, or a connection the network cut)
    after `take_back_own` ran. Nobody else claims them while we heartbeat."""
    known = {job.entry.entry_id for job in worker.jobs.values()}
    queues = [worker.idle_queues] + ([worker.stranded] if worker.stranded is not None else [])
    for queue in queues:
        for entry in queue.lost_own(known):
            log.warning(
                "taking back job %s pending under our id but never received", entry.entry_id
            )
            worker.accept(entry)


def rescue_stranded(worker: Worker, peers: list[dict], live: set[str]) -> None:
    queue = worker.stranded
    if queue is None or worker.draining or worker.other_class in decoder_classes(peers):
        return
    entries = queue.claim_orphans(live, worker.free_slots())
    entries += queue.read(worker.free_slots() - len(entries), None)
    for entry in entries:
        log.warning(
            "taking decode job %s stranded on %s (no live decoder there)",
            entry.entry_id,
            queue.streams[0],
        )
        worker.accept(entry)
