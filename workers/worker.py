"""A worker process: one engine, one device, one or more roles (prefill, decode).

The loop (vLLM v1's busy loop with Redis around it, never inside the model):
    schedule: cancels -> take work (bounded by free slots) -> start waiting decodes
    execute:  one engine step for the whole batch
    update:   publish the step's tokens in one pipeline -> end finished requests
              -> hand off sequences just prefilled (`Handoff`, handoff.py)
    then heartbeat / claim orphaned jobs / sweep expired KV leases (`Upkeep`, upkeep.py).

The Worker owns its jobs and the engine's slots; its collaborators own their state and get
only what they need. A prefill publishes the first token itself, then the handoff asks the
dispatcher where to decode: if the answer is this worker's own device class and it decodes
too, the sequence simply stays in the engine; else its KV goes to the KV store and a decode
job is queued.
A job's stream entry is acked only when the request is done with this worker, so a worker
that dies leaves it pending for another to claim and resume from the delivered tokens.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from functools import partial

import redis
from syshax.broker.cancel_watch import CancelWatcher
from syshax.broker.dispatcher import Dispatcher
from syshax.broker.keys import KEYS, Keys
from syshax.broker.kv_store import KVStore
from syshax.broker.schemas import TokenEvent
from syshax.broker.token_publisher import TokenPublisher
from syshax.broker.worker_io import Entry, Heartbeat, WorkQueues

from .decode_start import start_decode
from .engine import kv_prefault
from .engine.errors import KVIdentityError
from .engine.outputs import StepOutput, TokenCadence
from .engine.protocol import EngineProtocol
from .farm_view import FarmView
from .forks import Forks
from .handoff import Handoff
from .intake import Intake
from .job_poll import JobPoll
from .job_prefetch import JobPrefetch
from .metrics import WorkerMetrics
from .step_events import step_events
from .streams import Streams
from .upkeep import Upkeep, load_fields
from .worker_options import Job, WorkerOptions

log = logging.getLogger(__name__)


class Worker:
    def __init__(
        self,
        engine: EngineProtocol,
        r: redis.Redis,
        opts: WorkerOptions,
        dispatcher: Dispatcher,
        keys: Keys = KEYS,
        metrics: WorkerMetrics | None = None,
    ):
        self.engine, self.r, self.opts, self.keys = engine, r, opts, keys
        self.metrics = metrics or WorkerMetrics(
            opts.worker_id, opts.device_class, opts.served_model
        )
        self.dispatcher = dispatcher
        self.streams = Streams.open(r, opts, keys, engine.num_slots)
        self.publisher = TokenPublisher(r, keys, opts.output_ttl)
        self.cancels = CancelWatcher(r, keys)
        self.heartbeat = Heartbeat(r, opts.worker_id, keys, ttl=opts.heartbeat_ttl)
        self.kv = KVStore(r, keys, ttl=opts.kv_ttl, worker_id=opts.worker_id)
        self.jobs: dict[str, Job] = {}
        self.backlog: deque[Job] = deque()  # decode jobs waiting for a free slot
        self.forks = Forks()  # choices waiting for their request's prompt to be computed
        self.draining = False
        self.cadence = TokenCadence()
        # The poll for new work sent during the step, not before it (Redis streams only).
        self.prefetch = JobPrefetch() if self.streams.jobs.amqp is None else None
        # The collaborators: each given exactly what it needs, none given the Worker whole
        # (the upkeep sees it through `upkeep.KeptWorker`).
        self.farm = FarmView(r, keys, self.heartbeat, self.load_fields, self.streams.jobs)
        streams, kv, farm, m, hb = self.streams, self.kv, self.farm, self.metrics, self.heartbeat
        self.handoff = Handoff(
            engine, opts, dispatcher, r=r, keys=keys, streams=streams, kv=kv, farm=farm, metrics=m,
            ride=self.publisher.ride,
        )  # fmt: skip
        self.poll = JobPoll(streams, self.handoff, self.prefetch, opts.block_ms)
        self.upkeep = Upkeep(
            self, engine, opts, streams=streams, heartbeat=hb, kv=kv, farm=farm, metrics=m
        )
        self.intake = Intake(
            r,
            keys,
            streams.work,
            self.publisher,
            self.cancels,
            kv,
            opts.served_model,
            opts.worker_id,
        )

    # ---- the loop -----------------------------------------------------------------------

    def serve(self, stop: threading.Event, drain_timeout: float = 30.0) -> None:
        self.upkeep.start()
        while not stop.is_set():
            self.iterate()
        self.drain(drain_timeout)

    def iterate(self) -> None:
        """One turn: schedule -> execute + update (one engine step) -> the upkeep's timers."""
        self.metrics.last_turn = time.monotonic()
        self._schedule()
        if self.engine.has_unfinished():
            if self.engine.num_running == 0:  # prompts only: no stream waits on this step
                self.upkeep.on_timers(time.monotonic(), early=True)
                self.handoff.look_ahead()
                kv_prefault.ahead(self.engine)  # the next blocks' page faults, out of the steps
            self._prefetch_jobs()
            self._step()
        else:
            self.cadence.idle()
        # Records of requests that made no token lately; what rides on the next write (acks,
        # dispatch records) goes now when no step comes next.
        self.publisher.flush_due(idle=not self.engine.has_unfinished())
        self.upkeep.on_timers(time.monotonic())

    def _schedule(self) -> None:
        """Cancels first (their slots free up), then new work into the free slots, decodes
        from the backlog into the engine, and requests past their deadline dropped."""
        self._cancel(self.cancels.poll())
        self.upkeep.claim_waiting(time.monotonic())  # a dead worker's jobs before new work
        idle = not self.engine.has_unfinished() and not self.backlog
        if not self.draining:
            for entry in self._take(self._slots_for_new_work(idle), idle):
                self.accept(entry)
        for job in self.forks.ready(self.jobs):
            self._start_prefill(job)
        self._start_backlog()
        self._expire()

    def _prefetch_jobs(self) -> None:
        if not self.draining:
            slots = self._slots_for_new_work(idle=False)
            self.poll.before_step(slots, will_write=self.engine.num_running > 0)

    def _slots_for_new_work(self, idle: bool) -> int:
        """The free slots, or none while jobs of dead workers (or stranded ones) wait for room
        here: the next free slot is theirs (upkeep.claim_waiting), their clients being in the
        middle of a stream. An idle worker reads as usual: the claim just ran, so what still
        waits is being taken by another worker."""
        return self.free_slots() if idle or not self.upkeep.waiting else 0

    def _take(self, free: int, idle: bool) -> list[Entry]:
        return self.poll.take(free, idle, self.slots_held())

    @property
    def decode_slots(self) -> int:
        """The sequences this worker decodes at once (its heartbeat's capacity)."""
        return self.engine.num_slots - self.opts.handoff_slots

    def free_slots(self) -> int:
        return self.decode_slots - self.slots_held()

    def slots_held(self) -> int:
        """Sequences running or waiting here (the heartbeat's running + waiting)."""
        e = self.engine
        return e.num_running + e.num_waiting + len(self.backlog) + len(self.forks)

    def load_fields(self) -> dict:
        """The heartbeat's fields: this worker's load now (upkeep.load_fields)."""
        return load_fields(self.engine, self.opts, self.decode_slots, len(self.backlog), self.cadence, self.draining)  # fmt: skip

    def held_entries(self) -> set[tuple[str, str]]:
        """The stream entries of the jobs this process holds: (stream, entry id)."""
        return {(job.entry.stream, job.entry.entry_id) for job in self.jobs.values()}

    # ---- taking work --------------------------------------------------------------------

    def accept(self, entry: Entry) -> None:
        """Take an entry: a decode job into the backlog; the open choices of a prefill job
        into the engine, the first at once and the others once its prompt is computed (they
        then share its KV blocks through the prefix cache instead of computing it again)."""
        if entry.data is None:
            self.streams.work.ack(entry)
            return
        is_prefill = entry.stream in (self.keys.prefill_stream, self.keys.prefill_batch_stream)
        taken = self.intake.take(entry, is_prefill)
        jobs = []
        for job in taken.jobs:
            if job.request_id in self.jobs:  # a duplicate delivery of a choice running here
                self._let_go(job)
            else:
                jobs.append(job)
        if taken.refusal:
            for job in jobs:
                self._fail(job, taken.refusal, "server_error", dead_letter=taken.dead_letter)
            return
        for job in jobs:
            self.jobs[job.request_id] = job
        if not jobs:
            return
        if not is_prefill:
            jobs[0].in_process = True  # decode jobs are never handed off again
            self.backlog.append(jobs[0])
            return
        self._start_prefill(jobs[0])
        self.forks.wait(jobs[0].request_id, jobs[1:])

    def _start_prefill(self, job: Job) -> None:
        rid, prompt_ids, params = job.request_id, job.msg.prompt_ids, job.params
        if job.output_ids:  # taken over after it delivered tokens: recomputed with them
            outs = job.output_ids
            self._guard(job, lambda: self.engine.resume_request(rid, prompt_ids, outs, params))
        else:
            self._guard(job, lambda: self.engine.add_request(rid, prompt_ids, params))

    def _start_backlog(self) -> None:
        e = self.engine
        while self.backlog and e.num_running + e.num_waiting < self.decode_slots:
            job = self.backlog.popleft()
            # From its KV lease, else recomputed from its tokens (decode_start.py).
            self._guard(job, lambda job=job: start_decode(e, self.kv, self.metrics, job))

    def _guard(self, job: Job, start) -> None:
        """Start a job; a request the engine refuses ends with an error event, not a crash."""
        try:
            start()
        except KVIdentityError as exc:  # the farm's fault, not the request's: kept to inspect
            self._fail(job, str(exc), "server_error", dead_letter=True)
        except Exception as exc:  # noqa: BLE001 - any refusal must reach the client
            log.warning("request %s refused: %s", job.request_id, exc)
            kind = "invalid_request_error" if isinstance(exc, ValueError) else "server_error"
            self._fail(job, str(exc), kind)

    # ---- stepping -----------------------------------------------------------------------

    def _step(self) -> None:
        """Execute one engine step, then update: publish, end, hand off."""
        stats = self.engine.stats
        decode_steps = stats.decode_steps
        outs = self._execute()
        if outs is None:
            return
        # The rows the step decoded (None: it decoded nothing): the cadence's model input.
        rows = stats.steps.samples[-1][0] if stats.decode_steps > decode_steps else None
        self._update(outs, rows)

    def _execute(self) -> list[StepOutput] | None:
        """One engine step for the whole batch; None if the engine failed (its requests
        failed with it)."""
        try:
            return self.engine.step()
        except Exception as exc:  # noqa: BLE001 - the worker must survive an engine failure
            log.exception("engine step failed; failing its requests")
            for job in list(self.jobs.values()):
                self._fail(job, f"engine error: {exc}", "server_error")
            return None

    def _update(self, outs: list[StepOutput], rows: int | None) -> None:
        """The step's tokens out (the first token goes out before any KV handoff), with the
        acks of the requests it finished riding on the same write; then sequences just
        prefilled placed."""
        self._publish(outs, rows)
        for o in outs:
            job = self.jobs.get(o.request_id)
            if job is None or o.finished:
                continue
            if job.kind == "prefill" and not job.in_process and self.handoff.place(job):
                self.jobs.pop(job.request_id, None)  # its decode went elsewhere

    def _publish(self, outs: list[StepOutput], rows: int | None) -> None:
        """The step's tokens in one pipeline, the finished requests ended first so that their
        acks ride on it (`_let_go`); timed for the heartbeat's cadence model."""
        events, gateways = step_events(outs, self.jobs, self.opts.device, self.opts.worker_id)
        for o in outs:
            job = self.jobs.get(o.request_id) if o.finished else None
            if job is not None:
                self._done(job)
        self.poll.written(self.publisher.publish(events, gateways, self.poll.read_on_write()))
        self.cadence.published(rows, time.monotonic())
        self.metrics.generation_tokens.inc(len(outs))

    # ---- endings ------------------------------------------------------------------------

    def _done(self, job: Job) -> None:
        self.jobs.pop(job.request_id, None)
        self._let_go(job)

    def _let_go(self, job: Job) -> None:
        """`job` is done with its entry: acked (or dead-lettered) when no other job of it is
        held here (the other choices of a prefill job)."""
        claim, work = job.claim, self.streams.work
        if claim.let_go(job.request_id):
            if claim.dead_reason:
                work.dead_letter(claim.entry, claim.dead_reason)  # acks it too
            elif isinstance(work, WorkQueues):
                # On the next token write (a finished request's: the one with its last event)
                # instead of a round trip of its own. A crash before it leaves the entry
                # pending: whoever takes it over finds the request ended and acks it.
                self.publisher.ride(partial(work.add_ack, entry=claim.entry))
            else:
                work.ack(claim.entry)  # RabbitMQ's: not a Redis command

    def _fail(self, job: Job, message: str, kind: str, dead_letter: bool = False) -> None:
        """End a request with an error event; `dead_letter`: its job is moved to the dead
        letters with `message` as the reason (a job this worker must not run), not acked."""
        rid = job.request_id
        self.engine.abort(rid)
        seq = len(job.output_ids)
        code = 400 if kind == "invalid_request_error" else 500
        err = {"message": message, "type": kind, "code": code}
        self.publisher.publish(
            [TokenEvent(request_id=rid, seq=seq, error=err, worker=self.opts.worker_id)],
            {rid: job.msg.gateway},
        )
        if job in self.backlog:
            self.backlog.remove(job)
            self._free_lease(job)
        self.forks.discard(job)
        if dead_letter:
            job.claim.dead_reason = message
        self._done(job)

    def _free_lease(self, job: Job) -> None:
        """Free the KV lease of a decode job that never started (started ones took it)."""
        if job.kind == "decode" and job.msg.kv:
            self.kv.free(job.msg.kv.handle_id)

    def _cancel(self, request_ids: set[str]) -> None:
        for rid in request_ids:
            job = self.jobs.get(rid)
            if job is not None:
                self.engine.abort(rid)
                if job in self.backlog:
                    self.backlog.remove(job)
                    self._free_lease(job)
                self.forks.discard(job)
                self._done(job)
            self.kv.free_request(rid)
        if request_ids:
            self.publisher.settle(request_ids)  # their records complete: nothing more comes

    def _expire(self) -> None:
        now = time.time()
        for job in [j for j in self.jobs.values() if j.msg.deadline and now > j.msg.deadline]:
            log.info("request %s passed its deadline; dropping it", job.request_id)
            self._cancel({job.request_id})

    def drain(self, timeout: float) -> None:
        """SIGTERM: take no new work, finish what runs (up to `timeout`), hand back the rest."""
        self.draining = True
        self.streams.jobs.stop_pushes()  # RabbitMQ's pushed jobs to the other workers now
        self.poll.give_back()  # what the last step's poll read goes back for another worker
        end = time.monotonic() + timeout
        while (self.jobs or self.engine.has_unfinished()) and time.monotonic() < end:
            self.iterate()
        self.publisher.flush_all()  # whoever takes a request over reads its whole record
        requeued: set[tuple[str, str]] = set()
        for job in list(self.jobs.values()):
            # Requeue unchanged (once per entry: the choices of a prefill job share it;
            # entries of two streams can share an id): whoever takes it skips the choices
            # handed off and restarts the others.
            self.engine.abort(job.request_id)
            entry = (job.entry.stream, job.entry.entry_id)
            if entry not in requeued:
                requeued.add(entry)
                self.streams.work.requeue(job.entry)
            self.jobs.pop(job.request_id, None)
        self.forks.clear()
        self.upkeep.stop()
        self.cancels.close()
