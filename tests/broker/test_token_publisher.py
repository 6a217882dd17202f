"""TokenPublisher: one entry per gateway per step, requests' records written at their first
event, every CHECKPOINT_S and their end, and `delivered` whole in between (broker/token_log.py)."""

from __future__ import annotations

import time
import uuid

import pytest
import redis
from syshax.broker import token_log
from syshax.broker.dead_letters import error_entries
from syshax.broker.keys import Keys
from syshax.broker.schemas import TokenEvent, entry_events
from syshax.broker.token_publisher import TokenPublisher


@pytest.fixture
def r(redis_url):
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def keys():
    return Keys(prefix=f"tp{uuid.uuid4().hex[:8]}")


def tok(rid: str, seq: int, last: int = -1) -> TokenEvent:
    return TokenEvent(
        request_id=rid, seq=seq, token_id=seq, text=f"t{seq}",
        finish_reason="stop" if seq == last else None,
    )  # fmt: skip


def record(r, keys, rid) -> list[list[int]]:
    """The seqs of each entry of a request's record."""
    return [[e.seq for e in entry_events(f)] for _, f in r.xrange(keys.output_stream(rid))]


def test_a_step_is_one_entry_per_gateway_and_records_are_written_seldom(r, keys):
    pub = TokenPublisher(r, keys, output_ttl=60, write_interval=0)
    rids = [f"q{i}" for i in range(64)]
    gateways = {rid: ("g1" if i % 2 else "g2") for i, rid in enumerate(rids)}
    steps = 20
    for seq in range(steps):
        pub.publish([tok(rid, seq, steps - 1) for rid in rids], gateways)
    # each gateway's stream: one entry per step, holding its 32 requests' events
    for g in ("g1", "g2"):
        rows = r.xrange(keys.gateway_stream(g))
        assert len(rows) == steps
        assert all(len(entry_events(f)) == 32 for _, f in rows)
        assert 0 < r.ttl(keys.gateway_stream(g)) <= 60
    # each record: the first event at once, the rest at the end (20 steps < CHECKPOINT_S)
    for rid in rids:
        assert record(r, keys, rid) == [[0], list(range(1, steps))]
        assert 0 < r.ttl(keys.output_stream(rid)) <= 60
    assert pub.delivered("q0", gateways["q0"])[-1].finish_reason == "stop"


def test_held_events_are_delivered_from_the_gateway_stream(r, keys):
    """A worker that dies with events held back: the next one reads them (its record then the
    gateway's stream), each once, in order; the gateway stream is read once for them all."""
    dead = TokenPublisher(r, keys, write_interval=0)
    rids = [f"c{i}" for i in range(8)]
    for seq in range(6):
        dead.publish([tok(rid, seq) for rid in rids], dict.fromkeys(rids, "gw"))
    assert record(r, keys, "c0") == [[0]]  # 1-5 held back when it died
    heir = TokenPublisher(r, keys)
    reads = []
    xrange = r.xrange

    def counted(name, *a, **kw):
        if name == keys.gateway_stream("gw"):
            reads.append(kw["min"])
        return xrange(name, *a, **kw)

    r.xrange = counted
    try:
        for rid in rids:
            assert [e.seq for e in heir.delivered(rid, "gw")] == list(range(6)), rid
    finally:
        del r.xrange
    # the first read spans the stream; each later one goes on from its last entry (finds none)
    last = r.xrevrange(keys.gateway_stream("gw"), count=1)[0][0].decode()
    ms, seq = last.split("-")
    assert len(reads) == len(rids) and set(reads[1:]) == {f"{ms}-{int(seq) + 1}"}
    assert heir.delivered("c0") == heir.delivered("c0", "")  # no gateway: the record only
    assert [e.seq for e in heir.delivered("c0")] == [0]


def test_a_second_heir_finds_what_the_first_dead_worker_held_back(r, keys, monkeypatch):
    """A request resumed twice: the first heir writes into the record what the dead worker
    held back before its own events, so the second heir, which scans the gateway stream only
    from shortly before the record's last entry, still finds every token (without it: seqs
    0 and 6-7 only, and a resume from the wrong point)."""
    monkeypatch.setattr(token_log, "SKEW_MS", 1)  # "shortly before": 1 ms instead of 2 s
    gw = {"a": "gw"}
    dead = TokenPublisher(r, keys, write_interval=0)
    for seq in range(6):
        dead.publish([tok("a", seq)], gw)
    assert record(r, keys, "a") == [[0]]  # 1-5 held back when it died
    time.sleep(0.02)
    heir = TokenPublisher(r, keys, write_interval=0)
    assert [e.seq for e in heir.take_over("a", "gw")] == list(range(6))
    assert record(r, keys, "a") == [[0], [1, 2, 3, 4, 5]]  # before any event of its own
    time.sleep(0.02)
    heir.publish([tok("a", 6)], gw)
    heir.publish([tok("a", 7)], gw)  # both held back (its record exists): it dies with them
    assert record(r, keys, "a") == [[0], [1, 2, 3, 4, 5]]
    time.sleep(0.02)
    second = TokenPublisher(r, keys, write_interval=0)
    assert [e.seq for e in second.take_over("a", "gw")] == list(range(8))
    assert record(r, keys, "a") == [[0], [1, 2, 3, 4, 5], [6, 7]]
    assert second.take_over("a", "gw") == second.delivered("a", "gw")  # nothing more to write


def test_a_take_over_resumes_before_a_gap(r, keys, caplog):
    """Tokens after a gap in what was delivered cannot be a sequence's context: the heir
    resumes after the last token of the unbroken run from seq 0, and says so."""
    gw = {"g": "gw"}
    dead = TokenPublisher(r, keys, write_interval=0)
    for seq in range(5):
        dead.publish([tok("g", seq)], gw)
    entries = [eid for eid, _ in r.xrange(keys.gateway_stream("gw"))]
    r.xdel(keys.gateway_stream("gw"), entries[2])  # seq 2 lost (a trimmed stream)
    heir = TokenPublisher(r, keys, write_interval=0)
    assert [e.seq for e in heir.delivered("g", "gw")] == [0, 1, 3, 4]
    assert [e.seq for e in heir.take_over("g", "gw")] == [0, 1]
    assert "stop at seq 2" in caplog.text
    assert record(r, keys, "g") == [[0], [1]]  # the run before the gap, now in the record


def test_records_are_checkpointed_and_flushed(r, keys, monkeypatch):
    monkeypatch.setattr(token_log, "CHECKPOINT_S", 0.05)
    pub = TokenPublisher(r, keys, write_interval=0)
    pub.publish([tok("a", 0), tok("b", 0)], {"a": "g", "b": "g"})
    pub.publish([tok("a", 1), tok("b", 1)], {"a": "g", "b": "g"})
    pub.flush_due()  # not due yet
    assert record(r, keys, "a") == [[0]]
    time.sleep(0.06)
    pub.publish([tok("a", 2)], {"a": "g"})  # a's held events are due: written with this one
    assert record(r, keys, "a") == [[0], [1, 2]]
    assert record(r, keys, "b") == [[0], [1]]  # due too: flushed in the same pipeline
    pub.publish([tok("b", 2)], {"b": "g"})
    pub.flush_all()  # a worker stopping
    assert record(r, keys, "b") == [[0], [1], [2]]
    # a request without a gateway (a batch job): every step to its record, nothing else
    pub.publish([tok("x", 0)], {})
    pub.publish([tok("x", 1)], {})
    assert record(r, keys, "x") == [[0], [1]]


def test_an_error_has_its_own_entry_and_a_requeue_removes_it_for_good(r, keys):
    pub = TokenPublisher(r, keys)
    gw = {"e": "g"}
    pub.publish([tok("e", 0)], gw)
    pub.publish([tok("e", 1)], gw)
    err = TokenEvent(request_id="e", seq=2, error={"message": "boom"})
    pub.publish([err], gw)  # the worker's failure
    assert record(r, keys, "e") == [[0], [1], [2]]
    assert pub.delivered("e", "g")[-1].error == {"message": "boom"}
    ids = error_entries(r, "e", keys)
    assert len(ids) == 1
    r.xdel(keys.output_stream("e"), *ids)  # what a dead letter's requeue does
    # the gateway's stream still has the error; the resumed job must not see it
    assert [(e.seq, e.error) for e in TokenPublisher(r, keys).delivered("e", "g")] == [
        (0, None),
        (1, None),
    ]


def test_tokens_and_error_of_one_step_are_separate_entries(r, keys):
    pub = TokenPublisher(r, keys)
    pub.publish([tok("s", 0)], {"s": "g"})
    pub.publish([tok("s", 1)], {"s": "g"})  # held
    pub.publish([TokenEvent(request_id="s", seq=2, error={"message": "x"})], {"s": "g"})
    assert record(r, keys, "s") == [[0], [1], [2]]
    assert len(error_entries(r, "s", keys)) == 1


def test_merge_takes_only_tokens_of_the_request_from_the_gateway():
    rec = [tok("a", 0), tok("a", 1)]
    gw = [tok("a", 1), tok("b", 2), tok("a", 2), tok("a", 3, last=3)]
    gw.append(TokenEvent(request_id="a", seq=4, error={"message": "old"}))
    assert [e.seq for e in token_log.merge(rec, gw, "a")] == [0, 1, 2]
    assert token_log.scan_start("1700000005000-7") == "1700000003000-0"
    assert token_log.trim_before(1000.0) == f"{int((1000.0 - token_log.GATEWAY_KEEP_S) * 1000)}-0"


def test_steps_faster_than_the_write_interval_are_written_together(r, keys):
    pub = TokenPublisher(r, keys, write_interval=0.2)
    gw = {"w": "g", "v": "g"}
    pub.publish([tok("w", 0)], gw)  # a first event: at once
    pub.publish([tok("w", 1), tok("v", 0)], gw)  # v's first event: at once, with w's 1
    pub.publish([tok("w", 2), tok("v", 1)], gw)  # held back
    pub.publish([tok("w", 3), tok("v", 2)], gw)  # held back
    stream = keys.gateway_stream("g")
    assert [len(entry_events(f)) for _, f in r.xrange(stream)] == [1, 2]
    pub.flush_due()  # not due yet
    assert r.xlen(stream) == 2
    time.sleep(0.21)
    pub.flush_due()  # due: both held steps in one entry, each request's events in order
    rows = r.xrange(stream)
    assert [(e.request_id, e.seq) for e in entry_events(rows[-1][1])] == [
        ("w", 2), ("w", 3), ("v", 1), ("v", 2),
    ]  # fmt: skip
    pub.publish([tok("w", 4)], gw)  # held (just written)...
    pub.publish([tok("w", 5, last=5)], gw)  # ...and an end takes it along at once
    assert [e.seq for e in entry_events(r.xrange(stream)[-1][1])] == [4, 5]
    assert [e.seq for e in pub.delivered("w", "g")] == list(range(6))
    pub.publish([tok("v", 3)], gw)  # held; a worker stopping writes it
    pub.flush_all()
    assert [e.seq for e in pub.delivered("v", "g")] == [0, 1, 2, 3]


def test_a_request_that_leaves_has_its_record_completed_at_once(r, keys):
    pub = TokenPublisher(r, keys, write_interval=10.0)
    gw = {"c": "g", "d": "g"}
    pub.publish([tok("c", 0), tok("d", 0)], gw)
    pub.publish([tok("c", 1), tok("d", 1)], gw)  # held: both the step and the records
    pub.settle({"c"})  # cancelled: the held step goes out, and c's record gets its events
    assert record(r, keys, "c") == [[0], [1]]
    assert record(r, keys, "d") == [[0]]  # still running: its record waits
    assert r.xlen(keys.gateway_stream("g")) == 2
    pub.settle({"nothing-held"})  # no-op
    assert r.xlen(keys.gateway_stream("g")) == 2


def test_riders_go_with_the_next_write_or_alone_when_due(r, keys, monkeypatch):
    """An ack (or a dispatch record) rides on the next token write after its events, costing
    no round trip of its own; with no write coming it goes alone, after RIDE_MAX_S or at once
    for an idle caller, and with a worker that stops."""
    from syshax.broker import token_publisher

    pub = TokenPublisher(r, keys, write_interval=0.0)
    gw = {"a": "g"}
    pub.ride(lambda pipe: pipe.incr("rider:1"))
    pub.flush_due()  # not due: it waits for a write
    assert r.get("rider:1") is None
    sent = []
    original = r.connection_pool.get_connection

    def counted(*args, **kwargs):  # each pipeline takes one connection: one round trip
        sent.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(r.connection_pool, "get_connection", counted)
    pub.publish([tok("a", 0, last=0)], gw)  # an end: written at once, the rider with it
    assert len(sent) == 1 and r.get("rider:1") == b"1"
    assert [e.seq for e in pub.delivered("a", "g")] == [0]
    monkeypatch.setattr(token_publisher, "RIDE_MAX_S", 0.05)
    pub.ride(lambda pipe: pipe.incr("rider:2"))
    pub.flush_due()
    assert r.get("rider:2") is None
    time.sleep(0.06)
    pub.flush_due()  # past RIDE_MAX_S: alone
    assert r.get("rider:2") == b"1"
    pub.ride(lambda pipe: pipe.incr("rider:3"))
    pub.flush_due(idle=True)  # no step comes next: at once
    assert r.get("rider:3") == b"1"
    pub.ride(lambda pipe: pipe.incr("rider:4"))
    pub.flush_all()
    assert r.get("rider:4") == b"1"
