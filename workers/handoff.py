"""The PD handoff of a worker: where a just-prefilled sequence decodes, and moving it there.

Right after prefill the worker asks the dispatcher with a snapshot of both device classes.
If the answer is its own class and it decodes too, the sequence stays in its engine. Else
its KV goes to the KV store (shared memory when every decoder of the target class is on this
host, Redis otherwise) and a decode job is queued on the target class's stream, in the same
MULTI that acks the prefill entry.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from syshax.broker.dispatcher import Decision
from syshax.broker.schemas import DecodeJob
from syshax.broker.worker_io import device_loads, record_dispatch

from .engine.errors import EngineError

if TYPE_CHECKING:
    from syshax.broker.worker_io import Entry

    from .worker import Job, Worker

log = logging.getLogger(__name__)
# How often a worker with a slot to fill reads both classes' loads (one Redis round trip) for
# `take_queued` or `prefill_ahead`: a free CPU slot waits at most this long for either, and
# neither check runs at the worker's 5 ms poll, which on a CPU worker is every decode step.
LOAD_CHECK_S = 0.05


def _check_due(worker: Worker) -> bool:
    """Whether LOAD_CHECK_S has passed since the last `take_queued` / `prefill_ahead` check
    (a worker makes one of the two: a CPU decode worker the first, an xPU worker the second)."""
    now = time.monotonic()
    if now - worker.loads_checked_at < LOAD_CHECK_S:
        return False
    worker.loads_checked_at = now
    return True


def _loads_now(worker: Worker) -> dict:
    """Both classes' DeviceLoad: our own numbers live, the others' from their heartbeats."""
    static = worker.heartbeat.static
    me = {**static, **{k: str(v) for k, v in worker.load_fields().items()}}
    others = [w for w in worker.peers() if w.get("id") != worker.opts.worker_id]
    return device_loads(worker.r, [*others, me], worker.keys)


def decide(worker: Worker, job: Job) -> Decision:
    """Ask the dispatcher (and record its answer) for a sequence just prefilled here."""
    generated = len(worker.engine.output_ids(job.request_id))
    remaining = (job.params.max_tokens or worker.engine.max_model_len) - generated
    loads = _loads_now(worker)
    # This sequence already holds one of our slots (it was just prefilled here): counted in
    # our class's load, it would be counted twice as "one more stream", and a class exactly
    # full with it would look over capacity and send it away. (A prefill-only worker's load
    # is not in the decode classes' at all.)
    own = loads.get(worker.opts.device_class)
    if own is not None and "decode" in worker.opts.roles:
        own.running = max(own.running - 1, 0)
    decision = worker.dispatcher.choose(loads["gpu"], loads["cpu"], remaining)
    _record(worker, job.request_id, decision)
    return decision


def take_queued(worker: Worker) -> list[Entry]:
    """A CPU decode worker with a free slot: one decode job queued on the full xPU's stream,
    if the dispatcher's SLO rule lets the CPU take it (`Dispatcher.take_queued`), else none.
    The job's KV was exported when it was queued, so it is imported here like any handoff."""
    d = worker.dispatcher
    if worker.stranded is None or worker.opts.device_class != "cpu" or d.slo_itl_s is None:
        return []
    if not _check_due(worker):
        return []
    loads = _loads_now(worker)
    decision = d.take_queued(loads["gpu"], loads["cpu"])
    if decision is None:
        return []
    entries = worker.stranded.read(1, None)
    if entries:
        _record(worker, entries[0].entry_id, decision)
    return entries


def prefill_ahead(worker: Worker) -> list[Entry]:
    """An xPU worker whose decode slots are all busy: one waiting prompt into a handoff slot
    (`WorkerOptions.handoff_slots`), if the dispatcher would send a decode to the CPU now;
    its decode goes there right after the prefill step (`decide`). Without it a prompt waits
    for one of the xPU's decode slots before it is prefilled at all, and the CPU's slots
    empty meanwhile: on bench/hetero.py's saturated farm the CPU ran 6.5 of its 8 streams on
    average and ended at 88% of its standalone tok/s. Checked at most every LOAD_CHECK_S."""
    queue = worker.prefill_ahead
    if queue is None or worker.slots_held() >= worker.engine.num_slots:
        return []
    if not _check_due(worker):
        return []
    loads = _loads_now(worker)
    if not worker.dispatcher.offloads_next(loads["gpu"], loads["cpu"]):
        return []
    return queue.read(1, None)


def send(worker: Worker, job: Job, device_class: str, rule: str = "") -> None:
    """Export the sequence's KV and queue its decode job on `device_class`'s stream."""
    rid = job.request_id
    engine = worker.engine
    output_ids = engine.output_ids(rid)
    kv = None
    try:
        blob = engine.export_kv(rid)
    except EngineError as exc:
        # The sequence has left the engine either way (an export releases it): the decoder
        # recomputes it from the tokens, so nothing is lost but the prefill's work.
        log.warning("KV export of %s failed (%s); its decoder recomputes it", rid, exc)
    else:
        worker.metrics.kv_exports.inc()
        # A job queued on the full xPU may still be taken by a CPU worker (`take_queued`):
        # its KV must be where both classes' decoders can read it.
        store = _store_for(worker, {device_class, "cpu"} if rule == "slo_queue" else {device_class})
        kv = worker.kv.put(blob, engine.describe_kv(blob), rid, store)
    msg = job.msg
    decode = DecodeJob(
        request_id=rid,
        prompt_ids=msg.prompt_ids,
        output_ids=output_ids,
        params=msg.params,
        kv=kv,
        model=msg.model,
        created=msg.created,
        deadline=msg.deadline,
        priority=msg.priority,
    )
    # One MULTI: the decode job exists if and only if the prefill entry is acked.
    worker.queues.hand_over(job.entry, worker.keys.decode_stream(device_class), decode.pack())


def _store_for(worker: Worker, device_classes: set[str]) -> str:
    if worker.opts.kv_store != "auto":
        return worker.opts.kv_store
    hosts = {
        w.get("host")
        for w in worker.peers()
        if w.get("device_class") in device_classes and "decode" in w.get("roles", "")
    }
    return "shm" if hosts <= {worker.heartbeat.static["host"]} else "redis"


def _record(worker: Worker, what: str, decision: Decision) -> None:
    record_dispatch(worker.r, decision.device, decision.reason, worker.keys, decision.rule)
    labels = worker.metrics.labels
    worker.metrics.dispatch.labels(**labels, device=decision.device, rule=decision.rule).inc()
    log.debug("dispatch %s -> %s [%s] %s", what, decision.device, decision.rule, decision.reason)
