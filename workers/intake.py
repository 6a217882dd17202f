"""From a work-stream entry to the jobs a worker runs: the one job of a decode entry, or one job
per choice of a prefill entry that is still to be served.

A prefill job carries its request's prompt and parameters once for all of its `n` choices
(schemas.PrefillJob). Served here are the choices not cancelled, not already handed off by a
worker that held the entry before (broker/choices.py marks them in the handoff's MULTI) and,
for an entry taken over from a dead worker, not already finished; each resumes from the tokens
it delivered. A decode job of a choice of such a request names its request's stored part
(prompt and parameters) instead of carrying it: read once per request and cached here.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

import msgspec
import redis
from syshax.broker import choices
from syshax.broker.cancel_watch import CancelWatcher
from syshax.broker.keys import Keys
from syshax.broker.kv_store import KVStore
from syshax.broker.schemas import DecodeJob, PrefillJob, RequestPart, SchemaError, check_types
from syshax.broker.token_publisher import TokenPublisher
from syshax.broker.worker_io import Entry, WorkQueues
from syshax.shared.sampling import SamplingError, SamplingParams

from .worker_options import Claim, Job

PARTS_CACHED = 64  # requests whose stored part a worker keeps (their choices often come together)


@dataclass
class Taken:
    """What an entry gave: jobs to run, or jobs to fail at once with `refusal` (moving the
    entry to the dead letters when `dead_letter`)."""

    jobs: list[Job] = field(default_factory=list)
    refusal: str = ""
    dead_letter: bool = False


class Intake:
    def __init__(
        self,
        r: redis.Redis,
        keys: Keys,
        queues: WorkQueues,
        publisher: TokenPublisher,
        cancels: CancelWatcher,
        kv: KVStore,
        served_model: str = "",
        worker_id: str = "",
    ):
        self.r, self.keys, self.queues = r, keys, queues
        self.publisher, self.cancels, self.kv = publisher, cancels, kv
        self.served_model, self.worker_id = served_model, worker_id
        self._parts: OrderedDict[str, RequestPart] = OrderedDict()

    def take(self, entry: Entry, is_prefill: bool) -> Taken:
        """The jobs of `entry`; none when nothing of it is left to run (it was acked, or moved
        to the dead letters, here)."""
        try:
            if not entry.data:
                raise SchemaError("the entry has no job field 'j'")
            msg = (PrefillJob if is_prefill else DecodeJob).unpack(entry.data)
            stored = not is_prefill and bool(msg.part_of)
            params = None if stored else _params(msg.params)
        except (SchemaError, SamplingError, TypeError) as exc:
            self.queues.dead_letter(entry, f"undecodable job: {exc}")
            return Taken()
        if msg.deadline and time.time() > msg.deadline:
            self._drop(entry, msg)
            return Taken()
        taken = (
            self._prefill(entry, msg, params) if is_prefill else self._decode(entry, msg, params)
        )
        # A job of another model would be answered by this one's weights: refused, never run.
        # (A job naming no model was queued by hand, not by a gateway: taken as ours.)
        served = self.served_model
        if taken.jobs and served and msg.model and msg.model != served:
            if not is_prefill and msg.kv:
                self.kv.free(msg.kv.handle_id)
            taken.refusal = (
                f"job for model {msg.model!r}; worker {self.worker_id} serves {served!r}"
            )
            taken.dead_letter = True
        return taken

    def _drop(self, entry: Entry, msg: PrefillJob | DecodeJob) -> None:
        if isinstance(msg, DecodeJob) and msg.kv:
            self.kv.free(msg.kv.handle_id)
        self.queues.ack(entry)

    # ---- a prefill entry: its open choices ------------------------------------------------

    def _prefill(self, entry: Entry, msg: PrefillJob, params: SamplingParams | None) -> Taken:
        assert params is not None
        ids = msg.choice_ids()
        # Cancels of a job queued while this worker listened were heard: no flag to read.
        heard = not entry.reclaimed and self.cancels.covers(entry.entry_id)
        cancelled, handed = choices.open_choices(
            self.r, self.keys, msg.request_id, ids, entry.reclaimed, flags=not heard
        )
        if heard:
            cancelled = {cid for cid in ids if self.cancels.heard(cid)}
        claim = Claim(entry, set())
        jobs = []
        for i, cid in enumerate(ids):
            if cid in cancelled or i in handed:
                continue
            job = Job(claim, "prefill", msg, params.for_choice(i), cid, choice=i)
            if entry.reclaimed:
                # Not handed off, so no decode job names a lease of it: one its dead worker
                # exported just before the handoff's MULTI is freed now, not by the sweeper.
                self.kv.free_request(cid)
                if not self._resume(job):
                    continue  # it finished before its worker died
            jobs.append(job)
        if not jobs:
            self.queues.ack(entry)
            return Taken()
        claim.holders = {job.request_id for job in jobs}
        return Taken(jobs)

    def _resume(self, job: Job) -> bool:
        """A job taken over from a dead worker: the tokens it delivered are its start; False
        when it had delivered its last event already."""
        delivered = self.publisher.take_over(job.request_id, job.msg.gateway)
        if delivered and (delivered[-1].finish_reason or delivered[-1].error):
            return False
        job.output_ids = [ev.token_id for ev in delivered]
        return True

    # ---- a decode entry -------------------------------------------------------------------

    def _decode(self, entry: Entry, msg: DecodeJob, params: SamplingParams | None) -> Taken:
        rid = msg.request_id
        if self.cancels.is_cancelled(rid, entry.entry_id, entry.reclaimed):
            self._drop(entry, msg)
            return Taken()
        refusal = ""
        if msg.part_of:
            try:
                msg, params, refusal = self._with_part(msg)
            except (SchemaError, SamplingError, TypeError) as exc:
                self.queues.dead_letter(entry, f"undecodable request part: {exc}")
                if msg.kv:
                    self.kv.free(msg.kv.handle_id)
                return Taken()
        job = Job(Claim(entry, {rid}), "decode", msg, params or SamplingParams(), rid)
        job.choice, job.output_ids = msg.choice, list(msg.output_ids)
        if entry.reclaimed and not self._resume(job):
            self._drop(entry, msg)
            return Taken()
        if refusal and msg.kv:
            self.kv.free(msg.kv.handle_id)
        return Taken([job], refusal)

    def _with_part(self, msg: DecodeJob) -> tuple[DecodeJob, SamplingParams | None, str]:
        """The decode job with its request's stored prompt and parameters filled in, and this
        choice's parameters; a refusal when the part is gone."""
        part = self._parts.get(msg.part_of)
        if part is None:
            part = choices.request_part(self.r, self.keys, msg.part_of)
            if part is None:
                gone = f"the prompt and parameters of request {msg.part_of} are gone from Redis"
                return msg, None, gone
            self._parts[msg.part_of] = part
            if len(self._parts) > PARTS_CACHED:
                self._parts.popitem(last=False)
        else:
            self._parts.move_to_end(msg.part_of)
        params = _params(part.params).for_choice(msg.choice)
        full = msgspec.structs.replace(msg, prompt_ids=part.prompt_ids, params=part.params)
        return full, params, ""


def _params(raw: dict) -> SamplingParams:
    params = SamplingParams.from_dict(raw)
    check_types(params)  # a float seed or str stop id would fail a whole engine step
    return params
