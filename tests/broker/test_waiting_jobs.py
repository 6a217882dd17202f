"""Claims of a dead worker's entries (broker/waiting_jobs.py, WorkQueues.claim_orphans), and
the count of unread entries a worker holds its new reads back for (WorkQueues.unread)."""

from __future__ import annotations

import time

from syshax.broker.keys import KEYS
from syshax.broker.worker_io import CLAIM_MIN_IDLE_MS, WorkQueues

STREAM = KEYS.decode_stream("cpu")


def _read_as(r, consumer: str, n: int) -> list[str]:
    """`n` new entries read by `consumer` (pending under it until acked)."""
    queues = WorkQueues(r, [STREAM], consumer)
    queues.ensure_groups()
    return [e.entry_id for e in queues.read(n, None)]


def test_a_dead_workers_entries_are_found_behind_a_hundred_live_ones_oldest_first(r):
    for i in range(160):
        r.xadd(STREAM, {"j": b"job %d" % i})
    _read_as(r, "alive", 150)  # a live worker's 150 entries come first in the group's list
    dead = _read_as(r, "dead", 3)
    time.sleep(CLAIM_MIN_IDLE_MS / 1000 + 0.1)
    me = WorkQueues(r, [STREAM], "me")
    claim = me.claim_orphans({"alive", "me"}, 2)
    assert [e.entry_id for e in claim.entries] == dead[:2], "the oldest two of the dead one's"
    assert all(e.reclaimed and e.data for e in claim.entries)
    assert claim.left == 1, "the third waits for room"
    assert me.unread() == 160 - 153

    claim = me.claim_orphans({"alive", "me"}, 0)  # no room: seen, not taken
    assert (claim.entries, claim.left) == ([], 1)
    claim = me.claim_orphans({"alive", "me", "dead"}, 5)  # its heartbeat is back: not ours
    assert (claim.entries, claim.left) == ([], 0)


def test_an_orphan_another_worker_just_claimed_is_counted_as_left_not_taken(r):
    r.xadd(STREAM, {"j": b"job"})
    (entry_id,) = _read_as(r, "dead", 1)
    time.sleep(CLAIM_MIN_IDLE_MS / 1000 + 0.1)
    first = WorkQueues(r, [STREAM], "w1").claim_orphans({"w1", "w2"}, 4)
    assert [e.entry_id for e in first.entries] == [entry_id]
    # w2's look came before w1's claim (its heartbeat list is older): the id is still "dead"'s
    # to it, but XCLAIM refuses an entry claimed less than CLAIM_MIN_IDLE_MS ago.
    second = WorkQueues(r, [STREAM], "w2").claim_orphans({"w2"}, 4)
    assert second.entries == [] and second.left == 1


def test_unread_counts_what_no_consumer_has_read(r):
    queues = WorkQueues(r, [STREAM], "w")
    assert queues.unread() == 0, "no stream, no group yet"
    queues.ensure_groups()
    for _ in range(5):
        r.xadd(STREAM, {"j": b"job"})
    assert queues.unread() == 5
    (entry,) = queues.read(1, None)
    assert queues.unread() == 4
    queues.ack(entry)
    assert queues.unread() == 4
