"""Where a request's token events live, and how a reader puts its whole output together.

Every engine step writes each gateway's events of that step as ONE entry of the gateway's own
stream (`keys.gateway_stream`), which that gateway reads with a blocking XREAD: the live path,
one command per gateway per step whatever the number of requests (pub/sub did the same, but
lossy; a stream loses nothing over a reconnect). A request's own output stream
(`keys.output_stream`) is its record for everyone else (a resume, another gateway following it,
a worker taking it over, a batch reader): the worker writes it when the request's first event
comes, every `CHECKPOINT_S` (2 s) after, and at its end, each write carrying every event held
since the last one. So a request costs Redis a few XADDs over its life rather than one a step.

Between two checkpoints the newest events are only in the gateway's stream. A reader that needs
all of them (`merge`) takes the request's record and then the gateway stream's entries from a
little before the record's last entry (`scan_start`), keeping that request's events; the ends
(finish, error) are always in the record, written in the same step, so from the gateway stream
only tokens are taken. A request with no gateway (a batch job) has every step written to its
record, as its only reader reads nothing else.
"""

from __future__ import annotations

from collections.abc import Iterable

from .schemas import TokenEvent

# Most seconds a request's newest events wait before its record gets them. Readers of the
# record (a resume, a follower) scan the gateway stream for at most this much (plus SKEW_MS),
# so it bounds their work; writers save one XADD per request for every step in it. At 0.5 s
# the checkpoints were 60% of a real-paced farm's XADDs (20 ms steps, bench/broker_profile.py).
CHECKPOINT_S = 2.0
# Steps of an engine that steps faster than this are written together (one entry per gateway
# for all of them): Redis and the gateway pay per write, not per token, and at the echo
# engine's ~1 ms steps a write carried ~10 tokens (bench/broker_profile.py). A step with a
# request's first token or an end is never held. An engine stepping slower (every CPU engine,
# a GPU on a large batch) is written step by step, as before.
WRITE_INTERVAL_S = 0.005
# A gateway stream keeps its entries this long (trimmed by the writers with XADD MINID ~):
# far longer than any reader scans back (CHECKPOINT_S), and bounded memory. Workers whose clock
# is more than this ahead of Redis's would trim it early (their MINID is from their own clock).
GATEWAY_KEEP_S = 60.0
# How far before the record's last entry the scan of the gateway stream starts: the record and
# the gateway stream may be on different Redis Cluster nodes, whose clocks may differ a little.
SKEW_MS = 2000


def entry_key(entry_id: str | bytes) -> tuple[int, int]:
    """A stream entry id as (ms, seq), which orders as Redis does."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def entry_ms(entry_id: str | bytes) -> int:
    """The milliseconds part of a stream entry id."""
    return entry_key(entry_id)[0]


def next_id(entry_id: str | bytes) -> str:
    """The smallest stream id after `entry_id` (an exclusive start Redis < 6.2 takes too)."""
    ms, seq = entry_key(entry_id)
    return f"{ms}-{seq + 1}"


def scan_start(last_record_id: str | bytes) -> str:
    """Where a reader starts scanning the gateway stream after a record ending at this id."""
    return f"{max(0, entry_ms(last_record_id) - SKEW_MS)}-0"


def trim_before(now_s: float) -> str:
    """The MINID of a gateway stream written at wall time `now_s`."""
    return f"{int((now_s - GATEWAY_KEEP_S) * 1000)}-0"


def merge(
    record: Iterable[TokenEvent], gateway_events: Iterable[TokenEvent], request_id: str
) -> list[TokenEvent]:
    """A request's events in seq order, each once: its record's, then the tokens of it found in
    its gateway's stream beyond them (ends come only from the record, which always has them:
    an error a dead-letter requeue removed from the record must stay removed)."""
    by_seq: dict[int, TokenEvent] = {}
    for ev in record:
        by_seq.setdefault(ev.seq, ev)
    for ev in gateway_events:
        if ev.request_id != request_id or ev.error is not None or ev.finish_reason is not None:
            continue
        by_seq.setdefault(ev.seq, ev)
    return [by_seq[s] for s in sorted(by_seq)]


def ended(events: list[TokenEvent]) -> bool:
    return bool(events) and (events[-1].finish_reason is not None or events[-1].error is not None)
