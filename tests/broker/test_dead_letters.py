"""broker/dead_letters.py on a real Redis: what a requeue changes in a job (a fresh deadline,
no KV lease for a decode job, the request's error events gone), and what it refuses."""

from __future__ import annotations

import time

import pytest
from syshax.broker import dead_letters
from syshax.broker.keys import KEYS
from syshax.broker.kv_store import KVStore
from syshax.broker.schemas import DecodeJob, PrefillJob, TokenEvent
from syshax.broker.token_publisher import TokenPublisher
from syshax.broker.worker_io import WorkQueues


def _dead(r, stream: str, job, reason: str = "engine error: boom") -> str:
    queues = WorkQueues(r, [stream], "gone", KEYS)
    queues.ensure_groups()
    r.xadd(stream, {"j": job.pack()})
    (entry,) = queues.read(1, None)
    queues.dead_letter(entry, reason)
    return r.xrange(KEYS.dead_letter_stream)[-1][0].decode()


def test_a_requeued_decode_job_recomputes_its_kv_and_gets_its_budget_again(r):
    kv = KVStore(r, KEYS)
    handle = kv.put(b"kv-bytes", {"num_tokens": 3}, "req-d")
    now = time.time()
    job = DecodeJob(request_id="req-d", prompt_ids=[1, 2, 3], output_ids=[4], kv=handle,
                    created=now - 100, deadline=now - 40)  # fmt: skip
    stream = KEYS.decode_stream("cpu")
    letter = _dead(r, stream, job)
    # the token delivered before the failure (one step), then the worker's own error event
    publisher = TokenPublisher(r, KEYS)
    publisher.publish([TokenEvent(request_id="req-d", seq=0, token_id=4)])
    error = {"message": "boom", "type": "server_error"}
    publisher.publish([TokenEvent(request_id="req-d", seq=1, error=error)])
    (listed,) = dead_letters.list_dead(r, KEYS)
    assert (listed.id, listed.kind, listed.request_id) == (letter, "decode", "req-d")
    assert listed.reason == "engine error: boom" and listed.requeueable
    dead_letters.requeue(r, letter, KEYS, now=now)
    (entry,) = r.xrange(stream)
    again = DecodeJob.unpack(entry[1][b"j"])
    assert again.kv is None and again.output_ids == [4]
    assert again.deadline == pytest.approx(now + 60)  # its 60 s budget, from now
    assert not r.exists(KEYS.kv_lease(handle.handle_id))  # the lease is freed, not leaked
    events = TokenPublisher(r, KEYS).delivered("req-d")
    assert [(e.seq, e.error) for e in events] == [(0, None)]  # the failure is no longer output
    assert r.xlen(KEYS.dead_letter_stream) == 0


def test_a_requeue_keeps_a_longer_budget_and_no_deadline_stays_none(r):
    now = time.time()
    job = PrefillJob(request_id="req-p", prompt_ids=[1], created=now - 500, deadline=now - 200)
    letter = _dead(r, KEYS.prefill_stream, job)
    dead_letters.requeue(r, letter, KEYS, now=now)
    again = PrefillJob.unpack(r.xrange(KEYS.prefill_stream)[-1][1][b"j"])
    assert again.deadline == pytest.approx(now + 300)
    no_deadline = PrefillJob(request_id="req-q", prompt_ids=[1])
    letter = _dead(r, KEYS.prefill_batch_stream, no_deadline)
    dead_letters.requeue(r, letter, KEYS, now=now)
    again = PrefillJob.unpack(r.xrange(KEYS.prefill_batch_stream)[-1][1][b"j"])
    assert (again.request_id, again.deadline) == ("req-q", 0.0)


def test_refused_requeues_change_nothing(r):
    r.xadd(KEYS.dead_letter_stream, {"stream": "elsewhere:stream", "id": "1-0", "reason": "x",
                                     "j": PrefillJob(request_id="a").pack()})  # fmt: skip
    (letter,) = [i.decode() for i, _ in r.xrange(KEYS.dead_letter_stream)]
    with pytest.raises(dead_letters.DeadLetterError, match="not a work stream"):
        dead_letters.requeue(r, letter, KEYS)
    with pytest.raises(dead_letters.DeadLetterError, match="no dead letter"):
        dead_letters.requeue(r, "99-0", KEYS)
    with pytest.raises(dead_letters.DeadLetterError, match="no dead letter"):
        dead_letters.drop(r, "not-an-id", KEYS)
    assert r.xlen(KEYS.dead_letter_stream) == 1 and not r.exists("elsewhere:stream")
    dead_letters.drop(r, letter, KEYS)
    assert r.xlen(KEYS.dead_letter_stream) == 0


def test_actions_are_logged_with_who_did_them(r, caplog):
    letter = _dead(r, KEYS.prefill_stream, PrefillJob(request_id="req-log", prompt_ids=[1]))
    with caplog.at_level("WARNING", logger="syshax.broker.dead_letters"):
        dead_letters.drop(r, letter, KEYS, who="ops@10.0.0.9")
    (record,) = [m for m in caplog.messages if "dropped" in m]
    assert letter in record and "ops@10.0.0.9" in record and "req-log" in record
    assert "engine error: boom" in record
