"""CancelWatcher: a job queued while the worker listened is checked against the cancels it
heard, with no flag read; anything else (older jobs, reclaimed ones, after a reconnect) by
its flag (broker/cancel_watch.py)."""

from __future__ import annotations

import time
import uuid

import pytest
import redis
from syshax.broker import cancel_watch
from syshax.broker.cancel_watch import CancelWatcher, entry_ms
from syshax.broker.keys import Keys

from ..conftest import wait_for


@pytest.fixture
def keys():
    return Keys(prefix=f"cw{uuid.uuid4().hex[:8]}")


def _cancel(r: redis.Redis, keys: Keys, rid: str) -> None:
    """What a gateway does (client.GatewayBroker.cancel): the flag, then the publish."""
    r.set(keys.cancel_flag(rid), 1, ex=60)
    r.publish(keys.cancel_channel, rid)


def _queue(r: redis.Redis, keys: Keys) -> str:
    return r.xadd(keys.prefill_stream, {"j": b"x"}).decode()


def _exists_calls(r: redis.Redis) -> int:
    return int(r.info("commandstats").get("cmdstat_exists", {}).get("calls", 0))


def _listening(watch: CancelWatcher) -> None:
    """Wait until the subscription is confirmed (the watcher reads its socket when asked)."""
    assert wait_for(lambda: watch.covers(f"{int(time.time() * 1000) + 60_000}-0"), 5)
    time.sleep(0.005)  # a job queued in the very millisecond of the line is not covered


def test_a_job_queued_while_listening_needs_no_flag_read(r, keys):
    watch = CancelWatcher(r, keys)
    try:
        _listening(watch)
        kept, gone = _queue(r, keys), _queue(r, keys)
        _cancel(r, keys, "gone")
        r.config_resetstat()
        assert watch.is_cancelled("gone", gone) is True  # heard, in the socket until asked
        assert watch.is_cancelled("kept", kept) is False
        assert _exists_calls(r) == 0, "no flag was read"
        assert watch.poll() == {"gone"}  # and the loop still hears it once
        assert watch.poll() == set()
    finally:
        watch.close()


def test_older_reclaimed_and_foreign_jobs_read_their_flag(r, keys):
    before = _queue(r, keys)  # queued before the watcher subscribed
    _cancel(r, keys, "early")  # and cancelled then: the watcher never heard it
    watch = CancelWatcher(r, keys)
    try:
        _listening(watch)
        r.config_resetstat()
        assert watch.is_cancelled("early", before) is True
        later = _queue(r, keys)
        _cancel(r, keys, "late")
        assert watch.is_cancelled("late", later, reclaimed=True) is True
        assert watch.is_cancelled("early", "job-7") is True  # a RabbitMQ job's id
        assert _exists_calls(r) == 3
    finally:
        watch.close()


def test_a_reconnect_resets_the_line_until_the_new_subscription_is_confirmed(r, keys):
    watch = CancelWatcher(r, keys)
    try:
        _listening(watch)
        queued = _queue(r, keys)
        assert watch.covers(queued)
        # The server drops the pub/sub connection; cancels published meanwhile are lost.
        for c in r.client_list():
            if c.get("cmd") in ("subscribe", "ssubscribe") or int(c.get("sub", 0)):
                r.client_kill_filter(_id=c["id"])
        _cancel(r, keys, "lost")  # nobody is subscribed: this publish reaches no one
        with pytest.raises(redis.ConnectionError):
            for _ in range(50):  # the watcher notices the dead socket when it reads it
                watch.poll()
                time.sleep(0.02)
        assert not watch.covers(queued), "jobs queued before the reconnect: by their flag"
        r.config_resetstat()
        assert watch.is_cancelled("lost", queued) is True
        assert _exists_calls(r) == 1
        # Reading again reconnects and resubscribes; once confirmed, new jobs are covered.
        assert wait_for(lambda: watch.covers(f"{int(time.time() * 1000) + 60_000}-0"), 5)
        assert not watch.covers(queued)
    finally:
        watch.close()


def test_ids_let_go_raise_the_line(r, keys, monkeypatch):
    monkeypatch.setattr(cancel_watch, "RECENT_MAX", 2)
    watch = CancelWatcher(r, keys)
    try:
        _listening(watch)
        old = _queue(r, keys)
        for rid in ("a", "b", "c"):
            _cancel(r, keys, rid)
        assert wait_for(lambda: watch.poll() >= {"c"} or watch.heard("c"), 5)
        assert not watch.heard("a") and watch.heard("b") and watch.heard("c")
        # "a" was forgotten: a job queued before it was heard is checked by its flag again.
        assert not watch.covers(old)
        assert watch.is_cancelled("a", old) is True
    finally:
        watch.close()


def test_entry_ms_reads_stream_ids_only():
    assert entry_ms("1796578839852-0") == 1796578839852
    assert entry_ms("1796578839852-17") == 1796578839852
    assert entry_ms("job-7") is None and entry_ms("") is None and entry_ms("12") is None
