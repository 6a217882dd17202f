"""The farm with its job queues on RabbitMQ (`broker.jobs: amqp`, the machine's RabbitMQ at
127.0.0.1:5672): real gateway and worker processes streaming exactly the text of the Redis
transport's run (the echo engine's undisturbed text, which tests/reliability asserts for the
Redis streams), and decode workers SIGKILLed mid-stream: RabbitMQ redelivers their jobs,
whoever takes one resumes it from its delivered tokens, and every stream ends exactly. Skipped,
saying why, where no RabbitMQ answers."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from syshax.broker.amqp_connection import dead_letter_exchange
from syshax.broker.keys import DEVICE_CLASSES

from ..amqp_server import AMQP_URL, amqp_prefix, queue_counts  # noqa: F401 - the fixture
from ..farm_procs import ProcFarm
from .conftest import expected_text, messages
from .test_worker_kill import STEP_DELAY, check, run_chaos, stream_one


def start_farm(proc_farm, prefix: str, decoders: int, step_delay: float) -> ProcFarm:
    farm = proc_farm(jobs="amqp", amqp_url=AMQP_URL, prefix=prefix)
    farm.start_gateway()
    names = [farm.start_worker("xpu", roles="prefill", device_class="xpu")]
    names += [farm.start_worker(roles="decode", step_delay=step_delay) for _ in range(decoders)]
    farm.wait_registered(names)
    farm.wait_healthy()
    return farm


def assert_jobs_went_through_rabbitmq(farm: ProcFarm) -> None:
    """No job stream was ever written on Redis, and every queue and the dead letters are empty."""
    keys = farm.keys
    streams = [keys.prefill_stream, *(keys.decode_stream(c) for c in DEVICE_CLASSES)]
    assert not any(farm.r.exists(s) for s in streams)
    counts = queue_counts(keys)
    assert set(counts.values()) == {0}, counts
    assert counts[dead_letter_exchange(keys)] == 0


def test_farm_on_rabbitmq_streams_the_redis_runs_text(proc_farm, tokenizer, amqp_prefix):  # noqa: F811
    farm = start_farm(proc_farm, amqp_prefix, decoders=2, step_delay=0.0)
    n, max_tokens = 8, 40
    with ThreadPoolExecutor(n) as pool:
        outcomes = list(pool.map(lambda i: stream_one(farm, i, max_tokens, 0.0), range(n)))
    for o in outcomes:
        assert not o.error, o.error
        assert o.text == expected_text(tokenizer, messages(o.index), max_tokens)
        assert o.completion_tokens == max_tokens
    # Decoded on the CPU workers: the handoff went through the decode queue.
    workers = {e.worker for o in outcomes for e in farm.events(o.request_id)}
    assert any(w.startswith("cpu") for w in workers), workers
    left = farm.wait_quiescent()
    assert left == {"leases": (0, 0), "shm": [], "entries": 0, "pending": 0, "busy": {}}, left
    assert_jobs_went_through_rabbitmq(farm)


@pytest.mark.slow  # ~27 s on the shared 2-core VM
def test_decode_workers_killed_on_rabbitmq_lose_and_repeat_nothing(
    proc_farm,
    tokenizer,
    amqp_prefix,  # noqa: F811
):
    farm = start_farm(proc_farm, amqp_prefix, decoders=3, step_delay=STEP_DELAY)
    n = 12
    _, failures, kills, resumed, duplicated = run_chaos(
        farm, tokenizer, n, max_tokens=60, every=1.5, spread=3.0, max_kills=2
    )
    check(farm, n, failures, kills, resumed)
    assert duplicated == 0
    assert_jobs_went_through_rabbitmq(farm)


def greedy_texts(farm: ProcFarm, n: int, max_tokens: int) -> list[str]:
    farm.start_gateway()
    names = [farm.start_worker("xpu", "prefill", "xpu", engine="native")]
    names.append(farm.start_worker("cpu", "decode", "cpu", engine="native"))
    farm.wait_registered(names)
    farm.wait_healthy()
    with ThreadPoolExecutor(n) as pool:
        outcomes = list(pool.map(lambda i: stream_one(farm, i, max_tokens, 0.0), range(n)))
    assert not [o.error for o in outcomes if o.error]
    farm.stop()
    return [o.text for o in outcomes]


@pytest.mark.slow  # two farms of the real model: ~25 s on the shared VM
def test_real_model_greedy_text_is_the_same_on_both_transports(
    proc_farm,
    amqp_prefix,  # noqa: F811
):
    """SmolLM2 through a prefill worker and a CPU decode worker (the KV handed off): greedy
    text on RabbitMQ's job queues equals the Redis streams' run, request by request."""
    n, max_tokens = 4, 24
    on_redis = greedy_texts(proc_farm(decode_device="cpu"), n, max_tokens)
    on_amqp = greedy_texts(
        proc_farm(decode_device="cpu", jobs="amqp", amqp_url=AMQP_URL, prefix=amqp_prefix),
        n,
        max_tokens,
    )
    assert all(t.strip() for t in on_redis)
    assert on_amqp == on_redis
