"""A worker runs only its own model's work: a job naming another model, or a KV blob made by
other weights, is moved to the dead letters with the reason, and the request ends at once with
an error the client sees (no hang until request_timeout), its KV lease freed and nothing
recomputed. The gateway and the workers are the real ones (thread farm, echo engines whose KV
identity a test sets: a served name, and a weights label standing for a weights digest)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import openai
import pytest
import redis
from syshax.broker.dispatcher import Dispatcher
from syshax.broker.kv_store import KVStore
from syshax.broker.schemas import DecodeJob, PrefillJob
from syshax.workers.echo_engine import EchoEngine
from syshax.workers.worker import Worker, WorkerOptions

from ..conftest import wait_for

MESSAGES = [{"role": "user", "content": "Say something long enough to decode."}]


def _worker(farm, wid: str, roles: set[str], cls: str, served: str, weights: str = "w") -> Worker:
    opts = WorkerOptions(
        worker_id=wid,
        roles=frozenset(roles),
        device_class=cls,
        served_model=served,
        kv_store="redis",
        block_ms=20,
    )
    engine = EchoEngine(max_num_seqs=4, served_model=served, weights=weights)
    return Worker(engine, redis.Redis.from_url(farm.settings.redis_url), opts, Dispatcher(), farm.keys)  # fmt: skip


@contextmanager
def _serving(*workers: Worker) -> Iterator[None]:
    stop = threading.Event()
    threads = [threading.Thread(target=w.serve, args=(stop, 1.0), daemon=True) for w in workers]
    for t in threads:
        t.start()
    time.sleep(0.2)  # heartbeats: the prefill worker sees the decoders before the first handoff
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join(10)


def _refused(farm, match: str) -> None:
    """One chat completion ends with a 500 naming the refusal, within seconds."""
    start = time.monotonic()
    with pytest.raises(openai.InternalServerError, match=match):
        farm.client().chat.completions.create(model=farm.model, messages=MESSAGES, max_tokens=8)
    assert time.monotonic() - start < 10


def _dead_letters(farm, wait: bool = True) -> list[dict]:
    """The dead letters, once there is one (up to 5 s): the worker writes it right after the
    error event its client got, and on a loaded machine the test can read before it does."""
    if wait:
        wait_for(lambda: farm.r.xlen(farm.keys.dead_letter_stream) > 0, 5)
    return [
        {k.decode(): v for k, v in fields.items()}
        for _, fields in farm.r.xrange(farm.keys.dead_letter_stream)
    ]


def _nothing_left(farm, *workers: Worker) -> None:
    assert KVStore(farm.r, farm.keys).stats() == (0, 0)  # no KV lease leaked
    for stream in (farm.keys.prefill_stream, *map(farm.keys.decode_stream, ("xpu", "cpu"))):
        assert farm.r.xlen(stream) == 0  # acked and deleted: nothing pending or waiting
    for w in workers:
        assert not w.jobs and not w.engine.has_unfinished()


def test_a_decode_job_for_another_model_is_dead_lettered_and_fails(thread_farm):
    farm = thread_farm(workers=None)
    xpu = _worker(farm, "xpu", {"prefill"}, "xpu", served=farm.model)
    cpu = _worker(farm, "cpu0", {"decode"}, "cpu", served="another-model")
    with _serving(xpu, cpu):
        _refused(farm, f"job for model '{farm.model}'; worker cpu0 serves 'another-model'")
        dead = _dead_letters(farm)
        assert len(dead) == 1 and dead[0]["stream"].decode() == farm.keys.decode_stream("cpu")
        assert dead[0]["reason"].decode().startswith(f"job for model '{farm.model}'")
        job = DecodeJob.unpack(dead[0]["j"])  # kept whole, for inspection
        assert job.model == farm.model and job.kv is not None
        _nothing_left(farm, xpu, cpu)


def test_a_prefill_job_for_another_model_is_dead_lettered_and_fails(thread_farm):
    farm = thread_farm(workers=None)
    xpu = _worker(farm, "xpu", {"prefill", "decode"}, "xpu", served="another-model")
    with _serving(xpu):
        _refused(farm, "serves 'another-model'")
        dead = _dead_letters(farm)
        assert [d["stream"].decode() for d in dead] == [farm.keys.prefill_stream]
        assert PrefillJob.unpack(dead[0]["j"]).model == farm.model
        _nothing_left(farm, xpu)
        # A job naming no model (queued by hand, not by a gateway) is not checked.
        events = farm.events(farm.submit([5, 6, 7], max_tokens=3))
        assert [e.seq for e in events] == [0, 1, 2] and events[-1].finish_reason == "length"


def test_kv_of_other_weights_fails_the_request_with_the_lease_freed(thread_farm):
    farm = thread_farm(workers=None)
    xpu = _worker(farm, "xpu", {"prefill"}, "xpu", served=farm.model, weights="base")
    cpu = _worker(farm, "cpu0", {"decode"}, "cpu", served=farm.model, weights="fine-tune")
    with _serving(xpu, cpu):
        message = (
            f"KV blob comes from weights base of model '{farm.model}', this worker serves "
            f"weights fine-tune of '{farm.model}'"
        )
        _refused(farm, message)
        dead = _dead_letters(farm)
        assert len(dead) == 1 and dead[0]["reason"].decode().startswith(message)
        assert dead[0]["stream"].decode() == farm.keys.decode_stream("cpu")
        _nothing_left(farm, xpu, cpu)
        labels = cpu.metrics.labels
        registry = cpu.metrics.registry
        assert registry.get_sample_value("syshax:kv_recomputes_total", labels) == 0
        assert registry.get_sample_value("syshax:kv_imports_total", labels) == 0


def test_the_same_model_still_decodes_across_workers(thread_farm):
    """The control: same name, same weights: the KV moves and the request completes."""
    farm = thread_farm(workers=None)
    xpu = _worker(farm, "xpu", {"prefill"}, "xpu", served=farm.model)
    cpu = _worker(farm, "cpu0", {"decode"}, "cpu", served=farm.model)
    with _serving(xpu, cpu):
        out = farm.client().chat.completions.create(
            model=farm.model, messages=MESSAGES, max_tokens=8
        )
        assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 8
        labels = cpu.metrics.labels
        assert cpu.metrics.registry.get_sample_value("syshax:kv_imports_total", labels) == 1
        assert _dead_letters(farm, wait=False) == []
        _nothing_left(farm, xpu, cpu)
