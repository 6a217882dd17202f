"""A prefill worker killed (SIGKILL) while it prefills: another prefill worker claims the job
once the dead one's heartbeat expired and prefills it again; the client sees one clean stream."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from syshax.broker.keys import KEYS

from ..farm_procs import HEARTBEAT_TTL
from .conftest import expected_text, messages
from .test_worker_kill import stream_one

CLEAN = {"leases": (0, 0), "shm": [], "entries": 0, "pending": 0, "busy": {}}


def pending_on(farm, consumer: str) -> int:
    for c in farm.r.xinfo_consumers(KEYS.prefill_stream, KEYS.prefill_group):
        if c["name"].decode() == consumer:
            return int(c["pending"])
    return 0


def test_prefill_worker_killed_mid_prefill_is_prefilled_elsewhere(proc_farm, tokenizer):
    farm = proc_farm()
    farm.start_gateway()
    # A prefill that takes 2 s: long enough to kill the worker in the middle of it (and
    # shorter than the heartbeat TTL, which must exceed a worker's longest engine step).
    farm.start_worker("p-slow", roles="prefill", device_class="xpu", step_delay=2.0)
    farm.start_worker("d1", roles="decode", device_class="cpu", step_delay=0.01)
    farm.wait_registered(["p-slow", "d1"])
    farm.wait_healthy()
    n = 3
    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(stream_one, farm, i, 40, 0.0) for i in range(n)]
        end = time.monotonic() + 20
        while time.monotonic() < end and not (
            farm.r.xlen(KEYS.prefill_stream) == n and pending_on(farm, "p-slow")
        ):
            time.sleep(0.02)
        taken = pending_on(farm, "p-slow")
        assert taken >= 1, "the slow prefill worker is in the middle of a prefill"
        farm.kill("p-slow")
        killed_at = time.monotonic()
        farm.start_worker("p-fast", roles="prefill", device_class="xpu")
        outcomes = [f.result(60) for f in futures]
    recovered_in = time.monotonic() - killed_at
    for o in outcomes:
        assert not o.error, o.error
        assert o.text == expected_text(tokenizer, messages(o.index), 40)
        assert o.completion_tokens == 40 and o.finish_reason == "length"
        evs = farm.events(o.request_id)
        assert [e.seq for e in evs] == list(range(40)), "every token once, in order"
        assert evs[0].worker == "p-fast", "nothing came from the killed worker"
        assert {e.worker for e in evs[1:]} == {"d1"}
    assert farm.log("p-fast").count("claimed orphaned job") == taken
    assert recovered_in < HEARTBEAT_TTL + 10
    assert farm.wait_quiescent() == CLEAN
