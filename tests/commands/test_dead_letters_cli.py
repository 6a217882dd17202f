"""`syshax dead-letters` on a Redis farm (the default `broker.jobs: redis`): list, requeue and
drop through the job transport's dead-letter store (job_transport.open_dead_letters), on a real
Redis. RabbitMQ's: tests/broker/test_amqp_dead_letters.py."""

from __future__ import annotations

from syshax.broker.keys import KEYS
from syshax.broker.schemas import PrefillJob
from syshax.broker.worker_io import WorkQueues

from syshax.cli import main


def _dead(r, request_id: str) -> str:
    queues = WorkQueues(r, [KEYS.prefill_stream], "gone", KEYS)
    queues.ensure_groups()
    r.xadd(KEYS.prefill_stream, {"j": PrefillJob(request_id=request_id, prompt_ids=[1]).pack()})
    (entry,) = queues.read(1, None)
    queues.dead_letter(entry, "engine error: boom")
    return r.xrange(KEYS.dead_letter_stream)[-1][0].decode()


def test_list_requeue_and_drop(r, redis_url, capsys):
    first, second = _dead(r, "req-1"), _dead(r, "req-2")
    base = ["dead-letters", "--redis-url", redis_url]
    assert main([*base, "list"]) == 0
    out = capsys.readouterr().out
    assert out.index(second) < out.index(first)  # newest first
    assert "req-1" in out and "engine error: boom" in out
    assert main([*base, "requeue", first, "--yes"]) == 0
    assert f"{first}: requeued on {KEYS.prefill_stream}" in capsys.readouterr().out
    assert main([*base, "drop", second, "--yes"]) == 0
    assert r.xlen(KEYS.dead_letter_stream) == 0
    assert main([*base, "drop", second, "--yes"]) == 1
    assert "no dead letter" in capsys.readouterr().err
    assert main([*base, "list"]) == 0 and "no dead letters" in capsys.readouterr().out


def test_without_redis_it_says_so(capsys):
    assert main(["dead-letters", "--redis-url", "redis://127.0.0.1:1/0", "list"]) == 1
    assert "Redis unreachable" in capsys.readouterr().err
