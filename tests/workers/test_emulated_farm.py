"""An emulated xPU (`xpu.engine: emulated`, no model runs there) beside a real CPU decode
worker on the bundled model, as `syshax run` lays them out on a host without a GPU: the
dispatcher's config (slo.itl_ms, decode_device) decides where each decode runs, and every
decision reaches the dispatch log and the prefill worker's Prometheus counter with its rule.

Which worker produced a token is in its event (`TokenEvent.worker`): the first token always
comes from the prefill worker, the others from the worker that decoded."""

from __future__ import annotations

import os
import signal
import time
import uuid

import httpx
from syshax.broker.embedded import free_port
from syshax.broker.keys import KEYS
from syshax.broker.schemas import PrefillJob
from syshax.shared.sampling import SamplingParams

from ..conftest import wait_for

MAX_TOKENS = 6


def _submit(farm, prompt: list[int]) -> str:
    rid = uuid.uuid4().hex
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0).to_dict()
    now = time.time()
    job = PrefillJob(
        request_id=rid, prompt_ids=prompt, params=params, created=now, deadline=now + 120
    )
    farm.r.xadd(KEYS.prefill_stream, {"j": job.pack()})
    return rid


def _run(farm, prompts: list[list[int]]) -> dict[str, list]:
    """Submit the requests, wait until each finished; their events by request id."""
    rids = [_submit(farm, p) for p in prompts]

    def done(rid: str) -> bool:
        events = farm.events(rid)
        return bool(events) and events[-1].finish_reason is not None

    assert wait_for(lambda: all(done(rid) for rid in rids), timeout=90), {
        name: farm.log(name)[-2000:] for name in farm.worker_names()
    }
    out = {rid: farm.events(rid) for rid in rids}
    for events in out.values():
        assert [e.seq for e in events] == list(range(MAX_TOKENS)) and not events[-1].error
    return out


def _metric(port: int, device: str, rule: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith("syshax:dispatcher_decisions_total{") and (
            f'device="{device}"' in line and f'rule="{rule}"' in line
        ):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_the_slo_and_decode_device_decide_between_an_emulated_xpu_and_a_real_cpu(
    proc_farm, tokenizer
):
    # A very loose SLO: the emulated H100 keeps it with room to spare, so it takes every decode.
    farm = proc_farm(
        xpu_engine="emulated",
        xpu_profile="h100",
        slo_itl_ms=60_000,
        max_model_len=256,
        xpu_max_batch_size=8,
        cpu_max_batch_size=4,
        sched_idle=True,  # the product's default, checked below
    )
    cpu_args = ("--device", "cpu", "--threads", "1", "--port", "0")
    farm.start_worker("cpu", "decode", "cpu", engine="native", args=cpu_args)
    # The CPU worker first: the xPU worker sees it alive from its first decision on.
    farm.wait_registered(["cpu"], timeout=120)
    port_a = free_port()
    # engine None: the xPU class follows xpu.engine (emulated); the CPU worker runs the model.
    farm.start_worker("xpu-a", "prefill,decode", "xpu", engine=None, args=("--port", str(port_a)))
    farm.wait_registered(["xpu-a"], timeout=120)
    # cpu.sched_idle (true by default; the tests' farms turn it off): the CPU decode worker,
    # every thread of it, yields the shared cores to the xPU worker.
    cpu_pid, xpu_pid = farm.procs["cpu"].pid, farm.procs["xpu-a"].pid
    threads = [int(t) for t in os.listdir(f"/proc/{cpu_pid}/task")]
    assert {os.sched_getscheduler(t) for t in threads} == {os.SCHED_IDLE}, "and its threads"
    assert os.sched_getscheduler(xpu_pid) == os.SCHED_OTHER
    assert farm.r.hget(KEYS.worker("xpu-a"), "device") == b"emulated:h100"
    prompts = [tokenizer.encode(f"Request {i}: count to ten.") for i in range(4)]
    for events in _run(farm, prompts).values():
        assert {e.worker for e in events} == {"xpu-a"}, "within the SLO the xPU keeps it"
    log = [d.decode() for d in farm.r.lrange(KEYS.dispatch_log, 0, -1)]
    assert len(log) == 4 and all(" xpu [slo] xPU within the SLO (" in d for d in log), log
    assert _metric(port_a, "xpu", "slo") == 4.0 and _metric(port_a, "cpu", "slo") == 0.0
    assert farm.r.get(KEYS.dispatch_count("cpu")) is None

    # decode_device: cpu: every decode leaves the emulated xPU for the real CPU worker, which
    # imports the emulated KV blob (the real model's shape) and decodes it.
    farm.kill("xpu-a", signal.SIGTERM)
    farm.cfg.decode_device = "cpu"
    farm.save_config()
    port_b = free_port()
    farm.start_worker("xpu-b", "prefill,decode", "xpu", engine=None, args=("--port", str(port_b)))
    farm.wait_registered(["xpu-b"], timeout=120)
    farm.r.delete(KEYS.dispatch_log)
    for events in _run(farm, prompts[:2]).values():
        assert events[0].worker == "xpu-b", "the prefill worker sends the first token"
        assert {e.worker for e in events[1:]} == {"cpu"}, "decode_device cpu: the CPU decodes"
    log = [d.decode() for d in farm.r.lrange(KEYS.dispatch_log, 0, -1)]
    assert len(log) == 2 and all(" cpu [decode_device] decode_device is cpu" in d for d in log)
    assert _metric(port_b, "cpu", "decode_device") == 2.0
    left = farm.wait_quiescent()
    assert left["leases"] == (0, 0) and left["entries"] == 0 and left["pending"] == 0, left
