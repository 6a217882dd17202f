"""The PD handoff of a worker: where a just-prefilled sequence decodes, and moving it there.

Right after prefill the worker asks the dispatcher with a snapshot of both device classes.
If the answer is its own class and it decodes too, the sequence stays in its engine. Else
its KV goes to the KV store (shared memory when every decoder of the target class is on this
host, Redis otherwise) and a decode job is queued on the target class's stream, in the same
MULTI that acks the prefill entry.

Two reads fill a slot the handoff would otherwise leave empty: `take_queued` (a CPU decoder
takes a job waiting on the full xPU's stream) and `prefill_ahead` (an xPU worker prefills a
prompt into a handoff slot for the CPU to decode).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import redis
from syshax.broker import choices
from syshax.broker.dispatcher import Decision, DeviceLoad, Dispatcher
from syshax.broker.job_transport import JobQueue
from syshax.broker.keys import Keys
from syshax.broker.kv_store import KVStore
from syshax.broker.schemas import DecodeJob, RequestPart
from syshax.broker.token_publisher import Rider
from syshax.broker.worker_io import Entry, decoder_classes, record_dispatch

from .engine.errors import EngineError
from .engine.protocol import EngineProtocol
from .farm_view import FarmView
from .metrics import WorkerMetrics
from .streams import Streams
from .worker_options import Job, WorkerOptions

log = logging.getLogger(__name__)
# How often a worker with a slot to fill reads both classes' loads (one Redis round trip) for
# `take_queued` or `prefill_ahead`: a free CPU slot waits at most this long for either, and
# neither check runs at the worker's 5 ms poll, which on a CPU worker is every decode step.
LOAD_CHECK_S = 0.05


class Handoff:
    def __init__(
        self,
        engine: EngineProtocol,
        opts: WorkerOptions,
        dispatcher: Dispatcher,
        *,
        r: redis.Redis,
        keys: Keys,
        streams: Streams,
        kv: KVStore,
        farm: FarmView,
        metrics: WorkerMetrics,
        ride: Callable[[Rider], None],
    ):
        """`ride`: puts Redis writes on the worker's next token write (TokenPublisher.ride):
        the dispatch log's records go that way."""
        self.engine, self.opts, self.dispatcher = engine, opts, dispatcher
        self.r, self.keys, self.streams, self.kv = r, keys, streams, kv
        self.farm, self.metrics, self.ride = farm, metrics, ride
        # The prompts alone, read into a handoff slot while the decode slots are full: only a
        # worker that prefills and decodes and has handoff slots (WorkerOptions.handoff_slots).
        self.ahead: JobQueue | None = None
        if opts.handoff_slots > 0 and {"prefill", "decode"} <= opts.roles:
            self.ahead = streams.jobs.queues([keys.prefill_stream])
        self.loads_checked_at = 0.0  # LOAD_CHECK_S
        # The classes with a live decoder when one was last seen: while none is alive (all
        # restarting), a decode is queued where decoders were, not on the xPU's stream of a
        # farm that has no xPU decoder (where a decoder's rescue would have to fetch it).
        self.decoders_seen: set[str] = set()

    # ---- a sequence just prefilled ------------------------------------------------------

    def place(self, job: Job) -> bool:
        """Decide where `job`'s decode goes: False when it stays in this engine (marked
        `in_process`), True when it was sent away (it has left the engine, its entry acked)."""
        decision = self.without_loads(job) or self.decide(job)
        if decision.device == self.opts.device_class and "decode" in self.opts.roles:
            job.in_process = True
            return False
        self.send(job, decision.device, decision.rule)
        return True

    def look_ahead(self) -> None:
        """Before a step that computes prompts only (no stream waits on it): the live workers
        read now, so that `without_loads` needs no Redis read after it."""
        if self._no_cpu_rule_applies():
            self.farm.workers(force=True)

    def without_loads(self, job: Job) -> Decision | None:
        """The decision, when it cannot depend on the loads (`Dispatcher.settled`): a fixed
        decode device, or a farm where one class has no live decoder (as last read: by
        `look_ahead` before this prompt's prefill, or by the claim round, at most a claim
        period ago). The round trip of the loads (queue lengths) is then skipped: it sat
        between a stream's first token and its second. A decoder that just started is seen
        by the next read. With no live decoder at all, the classes of the last ones seen."""
        classes = decoder_classes(self.farm.workers(max_age=self.opts.claim_s))
        if "decode" in self.opts.roles:
            classes.add(self.opts.device_class)  # before our first heartbeat is read back
        if classes:
            self.decoders_seen = classes
        classes = classes or self.decoders_seen  # none alive: where decoders were last seen
        xpu, cpu = "xpu" in classes, "cpu" in classes
        if not self.dispatcher.settled(xpu, cpu):
            return None
        remaining = (job.params.max_tokens or self.engine.max_model_len) - len(
            self.engine.output_ids(job.request_id)
        )
        decision = self.dispatcher.choose(
            DeviceLoad(workers=int(xpu)), DeviceLoad(workers=int(cpu)), remaining
        )
        self._record(job.request_id, decision)
        return decision

    def _no_cpu_rule_applies(self) -> bool:
        return self.opts.device_class == "xpu" and "decode" in self.opts.roles

    def decide(self, job: Job) -> Decision:
        """Ask the dispatcher (and record its answer) for a sequence just prefilled here."""
        generated = len(self.engine.output_ids(job.request_id))
        remaining = (job.params.max_tokens or self.engine.max_model_len) - generated
        loads = self.farm.loads()
        # This sequence already holds one of our slots (it was just prefilled here): counted
        # in our class's load, it would be counted twice as "one more stream", and a class
        # exactly full with it would look over capacity and send it away. (A prefill-only
        # worker's load is not in the decode classes' at all.)
        own = loads.get(self.opts.device_class)
        if own is not None and "decode" in self.opts.roles:
            own.running = max(own.running - 1, 0)
        decision = self.dispatcher.choose(loads["xpu"], loads["cpu"], remaining)
        self._record(job.request_id, decision)
        return decision

    def send(self, job: Job, device_class: str, rule: str = "") -> None:
        """Export the sequence's KV and queue its decode job on `device_class`'s stream."""
        rid = job.request_id
        engine = self.engine
        output_ids = engine.output_ids(rid)
        kv = None
        try:
            blob = engine.export_kv(rid)
        except EngineError as exc:
            # The sequence has left the engine either way (an export releases it): the decoder
            # recomputes it from the tokens, so nothing is lost but the prefill's work.
            log.warning("KV export of %s failed (%s); its decoder recomputes it", rid, exc)
        else:
            self.metrics.kv_exports.inc()
            # A job queued on the full xPU may still be taken by a CPU worker (`take_queued`):
            # its KV must be where both classes' decoders can read it.
            readers = {device_class, "cpu"} if rule == "slo_queue" else {device_class}
            store = self._store_for(readers)
            kv = self.kv.put(blob, engine.describe_kv(blob), rid, store)
        msg = job.msg
        shared = msg.n > 1  # the prompt and parameters go to Redis once, not once per choice
        decode = DecodeJob(
            request_id=rid,
            prompt_ids=[] if shared else msg.prompt_ids,
            output_ids=output_ids,
            params={} if shared else msg.params,
            kv=kv,
            model=msg.model,
            created=msg.created,
            deadline=msg.deadline,
            priority=msg.priority,
            gateway=msg.gateway,
            part_of=msg.request_id if shared else "",
            choice=job.choice,
        )
        self._hand_over(job, self.keys.decode_stream(device_class), decode.pack())

    def _hand_over(self, job: Job, stream: str, data: bytes) -> None:
        """Queue the decode job and let go of the prefill entry. One MULTI: for a request with
        one choice the decode job exists if and only if the prefill entry is acked; for a
        choice of several, if and only if the choice is marked handed off (and the entry is
        acked with the last choice held here), so whoever takes the entry over after a crash
        serves only the choices not handed off."""
        claim, rid, msg = job.claim, job.request_id, job.msg
        if msg.n == 1:
            self.streams.work.hand_over(claim.entry, stream, data)
        else:
            part = (
                None
                if claim.part_stored
                else RequestPart(prompt_ids=msg.prompt_ids, params=msg.params)
            )
            self.streams.work.hand_over_choice(
                stream, data,
                request_id=msg.request_id, choice=job.choice, ttl=choices.part_ttl(msg.deadline),
                part=part, last=claim.entry if claim.is_last(rid) else None,
            )  # fmt: skip
            claim.part_stored = True
        claim.let_go(rid)

    def _store_for(self, device_classes: set[str]) -> str:
        if self.opts.kv_store != "auto":
            return self.opts.kv_store
        return "shm" if self.farm.decoder_hosts(device_classes) <= {self.farm.host} else "redis"

    # ---- filling a slot that would wait -------------------------------------------------

    def take_queued(self) -> list[Entry]:
        """A CPU decode worker with a free slot: one decode job queued on the full xPU's stream,
        if the dispatcher's SLO rule lets the CPU take it (`Dispatcher.take_queued`), else none.
        The job's KV was exported when it was queued, so it is imported here like any handoff."""
        d, stranded = self.dispatcher, self.streams.stranded
        if stranded is None or self.opts.device_class != "cpu" or d.slo_itl_s is None:
            return []
        if not self._check_due():
            return []
        loads = self.farm.loads()
        decision = d.take_queued(loads["xpu"], loads["cpu"])
        if decision is None:
            return []
        entries = stranded.read(1, None)
        if entries:
            self._record(entries[0].entry_id, decision)
        return entries

    def prefill_ahead(self, slots_held: int) -> list[Entry]:
        """An xPU worker whose decode slots are all busy (`slots_held` of them and its
        handoff slots): one waiting prompt into a handoff slot, if the dispatcher would send a
        decode to the CPU now; its decode goes there right after the prefill step (`decide`).
        Without it a prompt waits for one of the xPU's decode slots before it is prefilled at
        all, and the CPU's slots empty meanwhile: on bench/hetero.py's saturated farm the CPU
        ran 6.5 of its 8 streams on average and ended at 88% of its standalone tok/s.
        Checked at most every LOAD_CHECK_S."""
        if self.ahead is None or slots_held >= self.engine.num_slots:
            return []
        if not self._check_due():
            return []
        loads = self.farm.loads()
        if not self.dispatcher.offloads_next(loads["xpu"], loads["cpu"]):
            return []
        return self.ahead.read(1, None)

    def _check_due(self) -> bool:
        """Whether LOAD_CHECK_S has passed since the last `take_queued` / `prefill_ahead`
        check (a worker makes one of the two: a CPU decode worker the first, an xPU worker
        the second)."""
        now = time.monotonic()
        if now - self.loads_checked_at < LOAD_CHECK_S:
            return False
        self.loads_checked_at = now
        return True

    def _record(self, what: str, decision: Decision) -> None:
        self.ride(
            lambda pipe: record_dispatch(
                pipe, decision.device, decision.reason, self.keys, decision.rule
            )
        )
        labels = self.metrics.labels
        self.metrics.dispatch.labels(**labels, device=decision.device, rule=decision.rule).inc()
        log.debug(
            "dispatch %s -> %s [%s] %s", what, decision.device, decision.rule, decision.reason
        )
