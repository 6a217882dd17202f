"""Workers against a real Redis: prefill on one, decode on another, tokens delivered once each.

Uses the thread farm's echo workers (the zero-cost EchoEngine: output token i = prompt token
i), so the farm's paths run in seconds; the real engine's PD equality is tested in
test_farm_e2e.py.
"""

from __future__ import annotations

import time

import pytest
from syshax.broker.keys import KEYS
from syshax.broker.kv_store import KVStore


def submit_and_check_echoes(farm, requests: int, tokens: int) -> set[str]:
    """Submit `requests` 20-token prompts (request i: ids 10+i..29+i) for `tokens` tokens each;
    check each got every token once, in order, echoing its prompt, the first from the prefill
    worker; return the workers that produced the tokens after the first."""
    rids = [farm.submit(list(range(10 + i, 30 + i)), tokens) for i in range(requests)]
    for i, rid in enumerate(rids):
        evs = farm.events(rid)
        assert [e.seq for e in evs] == list(range(tokens))
        assert [e.token_id for e in evs] == list(range(10 + i, 10 + i + tokens))
        assert evs[0].worker == "xpu"  # the first token comes from the prefill worker
        assert evs[-1].finish_reason == "length"
    return {e.worker for rid in rids for e in farm.events(rid)[1:]}


def test_pd_request_is_decoded_elsewhere_with_every_token_once(thread_farm):
    with thread_farm(gateway=False, workers="echo", cpu_slots=4) as farm:
        devices = submit_and_check_echoes(farm, requests=6, tokens=12)
        assert "cpu0" in devices, "some decodes must have been offloaded to the CPU worker"
    assert KVStore(farm.r).stats() == (0, 0), "every KV lease was freed"
    assert farm.r.xlen(KEYS.prefill_stream) == 0 and farm.r.xlen(KEYS.decode_stream("cpu")) == 0


def test_a_failed_kv_export_is_recomputed_by_the_decoder(thread_farm, monkeypatch):
    """An engine that cannot export a sequence's KV (e.g. vLLM with an attention backend whose
    cache layout we do not read) has released it anyway: the decode job goes out without KV
    and the decoder recomputes it from the tokens; every token still arrives once."""
    from syshax.workers.echo_engine import EchoEngine
    from syshax.workers.engine.errors import RequestError

    def failing_export(self, rid, release=True):
        self.abort(rid)
        raise RequestError(f"KV of request {rid!r} not readable: test")

    monkeypatch.setattr(EchoEngine, "export_kv", failing_export)
    with thread_farm(gateway=False, workers="echo", cpu_slots=4) as farm:
        devices = submit_and_check_echoes(farm, requests=4, tokens=8)
        assert "cpu0" in devices
    assert KVStore(farm.r).stats() == (0, 0)


def test_auto_pd_offload_off_never_reaches_the_cpu_stream(thread_farm):
    with thread_farm(gateway=False, workers="echo", auto_pd_offload=False) as farm:
        rids = [farm.submit([5, 6, 7, 8], 6) for _ in range(8)]
        for rid in rids:
            assert all(e.worker == "xpu" for e in farm.events(rid))
        assert farm.r.get(KEYS.dispatch_count("cpu")) is None
        assert int(farm.r.get(KEYS.dispatch_count("xpu"))) == 8


def test_cpu_at_capacity_sends_jobs_to_the_xpu(thread_farm):
    with thread_farm(gateway=False, workers="echo", cpu_slots=1, xpu_slots=8) as farm:
        rids = [farm.submit([1, 2, 3], 40) for _ in range(6)]
        workers = [{e.worker for e in farm.events(rid)[1:]} for rid in rids]
        assert sum("cpu0" in w for w in workers) >= 1
        assert sum(w == {"xpu"} for w in workers) >= 4


def test_cancel_stops_generation_and_frees_everything(thread_farm):
    with thread_farm(gateway=False, workers="echo") as farm:
        rid = farm.submit([1, 2, 3, 4], 100_000 // 100)
        time.sleep(0.2)
        farm.r.set(KEYS.cancel_flag(rid), 1, ex=60)
        farm.r.publish(KEYS.cancel_channel, rid)
        time.sleep(0.3)
        n = farm.r.xlen(KEYS.output_stream(rid))
        time.sleep(0.3)
        assert farm.r.xlen(KEYS.output_stream(rid)) == n, "no tokens after the cancel"
        assert n < 1000
        assert all(len(w.jobs) == 0 and w.engine.num_running == 0 for w in farm.workers)
        assert all(w.engine.kv_blocks[0] == w.engine.kv_blocks[1] for w in farm.workers)
    assert KVStore(farm.r).stats() == (0, 0)


def test_poison_message_goes_to_dead_letter_and_queue_keeps_flowing(thread_farm):
    with thread_farm(gateway=False, workers="echo") as farm:
        farm.r.xadd(KEYS.prefill_stream, {"j": b"\xc1not msgpack"})
        rid = farm.submit([9, 9, 9], 3)
        assert len(farm.events(rid)) == 3
        dead = farm.r.xrange(KEYS.dead_letter_stream)
        assert len(dead) == 1 and b"undecodable" in dead[0][1][b"reason"]


def test_refused_request_gets_an_error_event(thread_farm):
    with thread_farm(gateway=False, workers="echo") as farm:
        rid = farm.submit(list(range(3000)), 3)  # over EchoEngine's max_model_len
        evs = farm.events(rid)
        assert len(evs) == 1 and evs[0].error["type"] == "invalid_request_error"
        assert "max_model_len" in evs[0].error["message"]


@pytest.mark.parametrize("store", ["shm", "redis"])
def test_kv_store_lease_round_trip_and_sweep(r, store):
    kv = KVStore(r, ttl=0.2)
    h = kv.put(b"x" * 1000, {"num_tokens": 3}, "req1", store=store)
    assert kv.stats() == (1, 1000)
    assert kv.take(h) == b"x" * 1000
    assert kv.stats() == (0, 0)
    kv.put(b"y" * 10, {}, "req2", store=store)
    kv.put(b"z" * 10, {}, "req3", store=store)
    assert kv.free_request("req2") == 1 and kv.stats()[0] == 1
    time.sleep(0.3)
    assert kv.sweep() == 1 and kv.stats() == (0, 0)
