"""Redis stopped and a new (empty) one started on the same port: while it is down the gateway
answers 503 with Retry-After and /health says why; workers keep their engine and reconnect
with a capped backoff (no process exits, nobody crash-loops); once Redis is back, new requests
succeed without restarting anything, and a stream caught by the outage ends instead of hanging.
"""

from __future__ import annotations

import re
import threading
import time

import httpx
import pytest

from ..farm_procs import ProcFarm
from .conftest import MODEL, expected_text, messages
from .test_worker_kill import Outcome, stream_one

CLEAN = {"leases": (0, 0), "shm": [], "entries": 0, "pending": 0, "busy": {}}


def start(proc_farm) -> ProcFarm:
    farm = proc_farm(request_timeout=120)
    farm.start_gateway()
    farm.start_worker("xpu", roles="prefill,decode", device_class="xpu", step_delay=0.02)
    farm.start_worker("cpu", roles="decode", device_class="cpu", step_delay=0.02)
    farm.wait_registered(["xpu", "cpu"])
    farm.wait_healthy()
    return farm


def assert_unavailable(farm: ProcFarm) -> None:
    body = {"model": MODEL, "messages": messages(0), "max_tokens": 4}
    r = httpx.post(farm.url() + "/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 503, r.text
    assert int(r.headers["retry-after"]) >= 1
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    # What is down, not where: the broker's address stays in the log.
    assert "message broker is unavailable" in err["message"], err
    assert str(farm.redis.port) not in err["message"] and "127.0.0.1" not in err["message"]
    h = httpx.get(farm.url() + "/health", timeout=10)
    assert h.status_code == 503 and "retry-after" in h.headers
    assert h.json()["redis"] == "unreachable"
    # /health is open to anyone: the reason says what is down, not where (no host:port).
    assert h.json()["reason"] == "the message broker is unreachable", h.text


def outage(farm: ProcFarm, seconds: float, tokenizer) -> tuple[Outcome, float]:
    """Redis down for `seconds` with a stream in flight; returns the stream's outcome and
    how long after Redis returned the farm served again."""
    caught: list[Outcome] = []
    t = threading.Thread(target=lambda: caught.append(stream_one(farm, 99, 400, 0.0)))
    t.start()
    time.sleep(1.0)  # the stream is running
    farm.stop_redis()
    end = time.monotonic() + seconds
    assert_unavailable(farm)
    while time.monotonic() < end:
        time.sleep(0.5)
    for name, proc in farm.procs.items():
        assert proc.poll() is None, f"{name} exited during the outage:\n{farm.log(name)[-2000:]}"
    farm.start_redis()
    back = time.monotonic()
    farm.wait_registered(["xpu", "cpu"], timeout=30)
    farm.wait_healthy(timeout=30)
    recovered = time.monotonic() - back
    t.join(60)
    assert not t.is_alive(), "the stream caught by the outage hangs"
    return caught[0], recovered


def check_after(farm: ProcFarm, tokenizer) -> None:
    client = farm.client()
    for i in range(4):
        resp = client.chat.completions.create(
            model=MODEL, messages=messages(i), max_tokens=20, temperature=0
        )
        assert resp.choices[0].message.content == expected_text(tokenizer, messages(i), 20)
    o = stream_one(farm, 7, 30, 0.0)
    assert not o.error and o.text == expected_text(tokenizer, messages(7), 30)
    for name in ("gateway", "xpu", "cpu"):
        assert farm.alive(name), f"{name} was restarted"
        assert "Traceback" not in farm.log(name), farm.log(name)[-3000:]
    assert farm.wait_quiescent() == CLEAN


def test_redis_restart_503_then_recovery_without_restarts(proc_farm, tokenizer):
    farm = start(proc_farm)
    assert stream_one(farm, 1, 10, 0.0).text == expected_text(tokenizer, messages(1), 10)
    caught, recovered = outage(farm, 3.0, tokenizer)
    # The stream in flight lost its job with Redis's data: it ends with an error event (the
    # client retries), soon after Redis is back, instead of hanging until request_timeout.
    assert "lost" in caught.error, caught.error
    assert caught.ended_at - caught.started_at < 3.0 + 10
    assert recovered < 15
    check_after(farm, tokenizer)
    for name in ("xpu", "cpu"):
        assert "Redis unreachable" in farm.log(name)


@pytest.mark.slow
def test_long_redis_outage_backoff_is_capped(proc_farm, tokenizer):
    farm = start(proc_farm)
    caught, recovered = outage(farm, 30.0, tokenizer)
    # Unreachable for longer than BROKER_OUTAGE_LIMIT: the stream ended during the outage.
    assert "unavailable" in caught.error, caught.error
    assert caught.ended_at - caught.started_at < 1 + 10 + 5
    for name in ("xpu", "cpu"):
        waits = [float(w) for w in re.findall(r"retrying in ([\d.]+)s", farm.log(name))]
        assert waits and max(waits) <= 10.0, waits  # capped exponential backoff
        assert len(waits) < 15, "no tight reconnect loop"
    assert recovered < 10.0 + 10
    check_after(farm, tokenizer)


def test_worker_survives_redis_losing_its_data_between_two_commands(redis_url):
    """A Redis that restarts empty within redis-py's own retry window: the next XREADGROUP
    meets NOGROUP instead of a connection error. The worker recreates its groups and serves."""
    import uuid

    import redis as redis_lib
    from syshax.broker.dispatcher import Dispatcher
    from syshax.broker.keys import KEYS
    from syshax.broker.schemas import PrefillJob, entry_events
    from syshax.shared.sampling import SamplingParams
    from syshax.workers.echo_engine import EchoEngine
    from syshax.workers.worker import Worker, WorkerOptions

    r = redis_lib.Redis.from_url(redis_url)

    def events(rid: str) -> list:  # a record's entry may hold several steps' events
        return [e for _, f in r.xrange(KEYS.output_stream(rid)) for e in entry_events(f)]

    opts = WorkerOptions("w", frozenset({"prefill", "decode"}), "xpu", block_ms=20)
    worker = Worker(EchoEngine(max_num_seqs=4), r, opts, Dispatcher(auto_pd_offload=False))
    stop = threading.Event()
    thread = threading.Thread(target=worker.serve, args=(stop, 1.0), daemon=True)
    thread.start()
    try:
        for _ in range(2):
            r.flushall()  # everything gone: streams, groups, heartbeats
            time.sleep(0.2)
            rid = uuid.uuid4().hex
            params = SamplingParams(max_tokens=3, temperature=0.0).to_dict()
            job = PrefillJob(request_id=rid, prompt_ids=[4, 5, 6], params=params)
            r.xadd(KEYS.prefill_stream, {"j": job.pack()})
            end = time.monotonic() + 10
            while len(events(rid)) < 3 and time.monotonic() < end:
                assert thread.is_alive(), "the worker died"
                time.sleep(0.02)
            assert [e.seq for e in events(rid)] == [0, 1, 2]
    finally:
        stop.set()
        thread.join(10)
        r.close()
