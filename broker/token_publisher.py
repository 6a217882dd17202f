"""The worker's writer of token events (sync redis-py); see token_log.py for the layout.

Per engine step (steps less than token_log.WRITE_INTERVAL_S apart are written together), in one pipeline without MULTI (its keys are in many slots) sent in one write:
the records due (a request's first event here, its end, or `CHECKPOINT_S` after its oldest
event held back), each with every event held for it, then one XADD per gateway with the step's
events of all its requests. A record's EXPIRE rides on its first and last write (and every
output_ttl/4 between), a gateway stream's every output_ttl/4.

Writes that need not go at once ride along (`ride`): a finished job's ack, a dispatch record.
Each was a round trip of its own per request; riding, they cost Redis no wakeup of their own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from . import token_log
from .connect import one_write_pipelines
from .keys import KEYS, Keys
from .schemas import SchemaError, TokenEvent, entry_events, pack_events
from .text import as_text

log = logging.getLogger(__name__)

SCAN_ALIGN_MS = 10_000  # a gateway stream is read back from a multiple of this (shared reads)
SCAN_REUSE_S = 2.0  # a read is extended, not repeated, within this long of the last use
SCAN_MAX_ENTRIES = 20_000  # ...and while it holds fewer entries than this
# A rider waits at most this long for the next write (`flush_due` sends it alone after): an
# ack or a dispatch record this late changes nothing a client sees, and a step of a real
# engine (10-50 ms) comes within it, so riders almost never cost a round trip of their own.
RIDE_MAX_S = 0.05

Rider = Callable[[redis.client.Pipeline], None]


@dataclass
class _Held:
    """A request's events not yet in its record."""

    since: float  # monotonic time of the oldest
    packed: list[bytes] = field(default_factory=list)


class TokenPublisher:
    def __init__(
        self,
        r: redis.Redis,
        keys: Keys = KEYS,
        output_ttl: int = 600,
        write_interval: float | None = None,
    ):
        self.r, self.keys, self.output_ttl = r, keys, output_ttl
        # token_log.WRITE_INTERVAL_S unless given (0: every step written as it comes)
        self.write_interval = (
            token_log.WRITE_INTERVAL_S if write_interval is None else write_interval
        )
        one_write_pipelines(r)  # a step's pipeline reaches Redis in one piece
        self._ttl_set: dict[str, float] = {}  # key -> monotonic time of its last EXPIRE
        self._held: dict[str, _Held] = {}  # request id -> events waiting for its record
        self._next_due = float("inf")  # monotonic time the oldest held events are due
        self._scans: dict[str, _Scan] = {}  # gateway -> its latest scan (delivered)
        self._steps: tuple[list[TokenEvent], dict[str, str]] | None = None  # held back
        self._last_write = float("-inf")  # monotonic time of the last step written
        self._riders: list[Rider] = []  # commands waiting for the next write (`ride`)
        self._ride_due = float("inf")  # monotonic time the oldest rider must go

    def ride(self, add: Rider) -> None:
        """`add(pipe)` puts commands on the next write's pipeline, after its events (so a
        request's ack goes out with, never before, its last event), within RIDE_MAX_S. For
        commands whose order against other round trips does not matter."""
        self._riders.append(add)
        self._ride_due = min(self._ride_due, time.monotonic() + RIDE_MAX_S)

    def _add_riders(self, pipe) -> None:
        riders, self._riders, self._ride_due = self._riders, [], float("inf")
        for add in riders:
            add(pipe)

    def publish(
        self,
        events: list[TokenEvent],
        gateways: dict[str, str] | None = None,
        read: Rider | None = None,
    ) -> list | None:
        """`gateways`: request id -> the id of the gateway that submitted it (from its job);
        a request without one (a batch job, read from its record) has its record written.

        A step that comes less than WRITE_INTERVAL_S after the last write is held back and
        goes with the next (or with `flush_due`), unless it has a request's first event or
        an end: an engine that steps faster than that has its steps written together.

        `read`: commands whose replies the caller wants (the worker's poll for new jobs), put
        last on this write: their replies (errors as exceptions, not raised), or None when
        nothing was written now (the caller reads another time)."""
        if not events:
            return None
        gateways = gateways or {}
        if self._steps is not None:
            held, held_gateways = self._steps
            events, gateways = held + events, {**held_gateways, **gateways}
            self._steps = None
        now = time.monotonic()
        if now - self._last_write < self.write_interval and not _urgent(events):
            self._steps = (events, gateways)
            return None
        return self._write(events, gateways, now, read)

    def _write(
        self,
        events: list[TokenEvent],
        gateways: dict[str, str],
        now: float,
        read: Rider | None = None,
    ) -> list | None:
        self._last_write = now
        by_request: dict[str, list[bytes]] = {}
        ended: set[str] = set()
        for ev in events:
            by_request.setdefault(ev.request_id, []).append(ev.pack())
            if ev.finish_reason is not None or ev.error is not None:
                ended.add(ev.request_id)
        pipe = self.r.pipeline(transaction=False)
        by_gateway: dict[str, list[bytes]] = {}
        for rid, packed in by_request.items():
            gateway = gateways.get(rid)
            if gateway:
                by_gateway.setdefault(gateway, []).extend(packed)
                if rid not in ended and self._held_back(rid, packed, now):
                    continue
            held = self._held.pop(rid, None)
            self._write_record(pipe, rid, held.packed + packed if held else packed, rid in ended)
        if now >= self._next_due:
            self._write_due(pipe, now)
        wall = time.time()
        for gateway, packed in by_gateway.items():
            stream = self.keys.gateway_stream(gateway)
            # MINID ~ trims whole listpack nodes only (cheap): the stream keeps ~GATEWAY_KEEP_S.
            pipe.xadd(
                stream, {"b": pack_events(packed)}, minid=token_log.trim_before(wall),
                approximate=True,
            )  # fmt: skip
            if self._ttl_due(stream, now, False):
                pipe.expire(stream, self.output_ttl)
        self._add_riders(pipe)
        if read is None:
            pipe.execute()
            return None
        start = len(pipe)  # (a cluster pipeline keeps its commands elsewhere)
        read(pipe)
        replies = pipe.execute(raise_on_error=False)
        ours = replies[:start]
        for reply in ours:  # the write's own errors raise as they would without `read`
            if isinstance(reply, Exception):
                raise reply
        return replies[start:]

    def _held_back(self, rid: str, packed: list[bytes], now: float) -> bool:
        """Hold a gateway's request's events back from its record (its gateway stream has
        them) unless its record has none yet here or its oldest held event is due."""
        held = self._held.get(rid)
        if held is None:
            if rid not in self._ttl_set:
                return False  # the first event here: written now (and the record's TTL set)
            self._held[rid] = _Held(now, list(packed))
            self._next_due = min(self._next_due, now + token_log.CHECKPOINT_S)
            return True
        if now - held.since >= token_log.CHECKPOINT_S:
            return False
        held.packed += packed
        return True

    def flush_due(self, idle: bool = False) -> None:
        """Write what is due: steps held back past WRITE_INTERVAL_S, the records whose held
        events are due (a request that made no event since: it moved to another worker, was
        cancelled, or waits), and riders past RIDE_MAX_S, or all of them when the caller is
        `idle` (no next step would carry them). Call between steps."""
        now = time.monotonic()
        if self._steps is not None and now - self._last_write >= self.write_interval:
            events, gateways = self._steps
            self._steps = None
            self._write(events, gateways, now)
        records_due = now >= self._next_due
        riders_due = bool(self._riders) and (idle or now >= self._ride_due)
        if not (records_due or riders_due):
            return
        pipe = self.r.pipeline(transaction=False)
        if records_due:
            self._write_due(pipe, now)
        self._add_riders(pipe)
        pipe.execute()

    def settle(self, request_ids: set[str]) -> None:
        """Requests that leave this worker (cancelled, expired): their records get every
        event held for them now, so a record stops growing once its request has stopped."""
        if self._steps is not None:
            events, gateways = self._steps
            self._steps = None
            self._write(events, gateways, time.monotonic())
        held = [rid for rid in request_ids if rid in self._held]
        if not held:
            return
        pipe = self.r.pipeline(transaction=False)
        for rid in held:
            self._write_record(pipe, rid, self._held.pop(rid).packed, False)
        pipe.execute()

    def flush_all(self) -> None:
        """Every held step and event written (a worker stopping)."""
        if self._steps is not None:
            events, gateways = self._steps
            self._steps = None
            self._write(events, gateways, time.monotonic())
        if not self._held and not self._riders:
            return
        pipe = self.r.pipeline(transaction=False)
        self._write_due(pipe, float("inf"))
        self._add_riders(pipe)
        pipe.execute()

    def _write_due(self, pipe, now: float) -> None:
        due = [rid for rid, h in self._held.items() if now - h.since >= token_log.CHECKPOINT_S]
        for rid in due:
            self._write_record(pipe, rid, self._held.pop(rid).packed, False)
        oldest = min((h.since for h in self._held.values()), default=float("inf"))
        self._next_due = oldest + token_log.CHECKPOINT_S

    def _write_record(self, pipe, rid: str, packed: list[bytes], ended: bool) -> None:
        out = self.keys.output_stream(rid)
        errors = [p for p in packed if _is_error(p)] if ended else []
        tokens = [p for p in packed if p not in errors] if errors else packed
        # An error gets an entry of its own: a dead-letter requeue removes exactly those
        # (dead_letters.error_entries) and never an entry with tokens in it.
        for part in (tokens, errors):
            if part:
                fields = {"e": part[0]} if len(part) == 1 else {"b": pack_events(part)}
                # No MAXLEN: a request's events are bounded by its max_tokens, and the stream
                # expires; the trim's arguments cost Redis ~10% of an XADD (bench/broker.py).
                pipe.xadd(out, fields)
        if self._ttl_due(rid, time.monotonic(), ended):
            pipe.expire(out, self.output_ttl)

    def _ttl_due(self, key: str, now: float, ended: bool) -> bool:
        last = self._ttl_set.get(key)
        if ended:
            self._ttl_set.pop(key, None)
            return True
        if last is not None and now - last < self.output_ttl / 4:
            return False
        self._ttl_set[key] = now
        if len(self._ttl_set) > 4096:  # requests cancelled or moved away never sent a last event
            old = [k for k, t in self._ttl_set.items() if now - t > self.output_ttl]
            for k in old:
                del self._ttl_set[k]
        return True

    # ---- reading back --------------------------------------------------------------------
    def delivered(self, request_id: str, gateway: str = "") -> list[TokenEvent]:
        """Every event already delivered for a request: its record, and the tokens of it in
        its gateway's stream beyond the record."""
        return self._delivered(request_id, gateway)[1]

    def take_over(self, request_id: str, gateway: str = "") -> list[TokenEvent]:
        """The events a worker resumes a dead one's request from: `delivered`, after writing
        into the record those it lacks (the dead worker held them back; only its gateway's
        stream has them). Readers scan the gateway stream from shortly before the record's
        last entry only, so the record must hold every older event before this worker adds
        its own: otherwise, when this worker dies too, the next one finds the tokens between
        the two record entries nowhere and resumes from the wrong point (seen in
        tests/reliability: a request resumed from seq 3 after a second kill, its seqs 3-34
        made twice). Only the unbroken run from seq 0 is returned: tokens after a gap
        cannot be a sequence's context."""
        in_record, events = self._delivered(request_id, gateway)
        unbroken = 0
        while unbroken < len(events) and events[unbroken].seq == unbroken:
            unbroken += 1
        if unbroken < len(events):
            log.warning(
                "resuming %s: its delivered events stop at seq %d and go on from %d; resumed "
                "after seq %d", request_id, unbroken, events[unbroken].seq, unbroken - 1,
            )  # fmt: skip
            events = events[:unbroken]
        missing = [ev.pack() for ev in events if ev.seq not in in_record]
        if missing:
            pipe = self.r.pipeline(transaction=False)
            self._write_record(pipe, request_id, missing, token_log.ended(events))
            pipe.execute()
        return events

    def _delivered(self, request_id: str, gateway: str) -> tuple[set[int], list[TokenEvent]]:
        """(the seqs in the record, every delivered event in seq order)."""
        record: list[TokenEvent] = []
        last = ""
        for entry_id, fields in self.r.xrange(self.keys.output_stream(request_id)):
            last = entry_id
            try:
                record += entry_events(fields)
            except SchemaError as exc:
                log.warning("output of %s: skipping entry %s: %s", request_id, entry_id, exc)
        events = token_log.merge(record, [], request_id)
        in_record = {ev.seq for ev in events}
        if not gateway or not last or token_log.ended(events):
            return in_record, events  # no record yet: nothing was delivered (a first is written)
        scanned = self._scan(gateway, token_log.scan_start(last), request_id)
        return in_record, token_log.merge(events, scanned, request_id)

    def _scan(self, gateway: str, start: str, request_id: str) -> list[TokenEvent]:
        """The request's events in a gateway's stream from entry id `start`. A dead worker's
        requests are resumed one after another: the stream is read from `start` rounded down
        to SCAN_ALIGN_MS, indexed by request, and a read made a moment ago from no later a
        point is extended rather than repeated, so a wave of resumes reads and decodes the
        stream about once."""
        now = time.monotonic()
        ms = token_log.entry_key(start)[0]
        base = f"{ms - ms % SCAN_ALIGN_MS}-0"
        scan = self._scans.get(gateway)
        fresh = scan is not None and now - scan.at < SCAN_REUSE_S
        if not (
            fresh
            and token_log.entry_key(scan.start) <= token_log.entry_key(base)
            and scan.entries < SCAN_MAX_ENTRIES
        ):
            scan = _Scan(now, base)
        begin = token_log.next_id(scan.last) if scan.last else scan.start
        for entry_id, fields in self.r.xrange(self.keys.gateway_stream(gateway), min=begin):
            scan.last, scan.entries = as_text(entry_id), scan.entries + 1
            try:
                events = entry_events(fields)
            except SchemaError as exc:
                log.warning("gateway stream %s: skipping entry %s: %s", gateway, entry_id, exc)
                continue
            for ev in events:
                scan.by_request.setdefault(ev.request_id, []).append((scan.last, ev))
        scan.at = now
        self._scans = {gateway: scan}  # the latest gateway's only
        after = token_log.entry_key(start)
        return [
            ev
            for eid, ev in scan.by_request.get(request_id, ())
            if token_log.entry_key(eid) >= after
        ]


@dataclass
class _Scan:
    at: float  # monotonic time of its last use
    start: str  # the entry id it starts at
    last: str = ""  # the last entry id read
    entries: int = 0
    by_request: dict[str, list[tuple[str, TokenEvent]]] = field(default_factory=dict)


def _urgent(events: list[TokenEvent]) -> bool:
    """A request's first event (its time to first token; the handoff follows it) or an end."""
    return any(ev.seq == 0 or ev.finish_reason is not None or ev.error is not None for ev in events)


def _is_error(packed: bytes) -> bool:
    return b"\xa5error" in packed and TokenEvent.unpack(packed).error is not None
