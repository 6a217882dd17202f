"""The whole farm with the real model: real worker processes, a real Redis, the real gateway,
the official `openai` client. The xPU worker only prefills and the CPU worker only decodes,
so every request here crosses processes through a KV handoff."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import pytest
from syshax.broker.keys import KEYS
from syshax.broker.kv_store import KVStore

from .farm_procs import ProcFarm

MODEL = "SmolLM2-135M-Instruct"
MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow."}]
MAX_LEN = 512


def model_farm(tmp: Path, cpu_env: dict[str, str] | None = None) -> ProcFarm:
    """A process farm on the real model: an xPU-class worker that only prefills ("xpu") and a
    CPU worker that only decodes ("cpu", with `cpu_env` added to its environment), one thread
    each, behind a gateway; started and ready."""
    farm = ProcFarm(
        tmp, max_model_len=MAX_LEN, request_timeout=120, xpu_max_batch_size=4, cpu_max_batch_size=4
    )
    try:
        farm.start_gateway()
        defaults = {"engine": "native", "heartbeat_ttl": None, "drain_timeout": None}
        farm.start_worker("xpu", "prefill", "xpu", args=("--threads", "1"), **defaults)
        cpu_args = ("--device", "cpu", "--threads", "1")
        farm.start_worker("cpu", "decode", "cpu", args=cpu_args, env=cpu_env, **defaults)
        farm.wait_registered(["xpu", "cpu"], timeout=180)
        farm.wait_healthy(timeout=180)
    except BaseException:
        farm.stop()
        raise
    return farm


@pytest.fixture(scope="module")
def farm(tmp_path_factory):
    with model_farm(tmp_path_factory.mktemp("farm")) as f:
        yield f


def local_engine(quantize: str = "stored"):
    """An in-process engine with a farm worker's weights: on this GPU-less host every worker
    runs the CPU default rule (the GGUF's own blocks, the fused step) unless its environment
    asks for another `quantize`."""
    from syshax.workers.engine.engine import Engine

    return Engine(
        None,
        max_model_len=MAX_LEN,
        max_num_seqs=1,
        progress=False,
        quantize=quantize,
        op_mode="fused",
    )


@pytest.fixture(scope="module")
def reference():
    """Greedy output of one undisturbed engine (no farm), the text PD must reproduce."""
    from syshax.shared.sampling import SamplingParams

    eng = local_engine()

    def run(messages, max_tokens: int) -> tuple[str, list[int]]:
        ids = eng.tokenizer.encode_chat(messages)
        outs = list(
            eng.generate(
                ids, SamplingParams(max_tokens=max_tokens, temperature=0.0), request_id="ref"
            )
        )
        return "".join(o.text for o in outs), [o.token_id for o in outs]

    return run


def test_pd_request_equals_single_worker_greedy_run(farm, reference):
    expected_text, expected_ids = reference(MESSAGES, 24)
    resp = farm.client(timeout=120).chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0
    )
    assert resp.choices[0].message.content == expected_text
    assert resp.usage.completion_tokens == len(expected_ids)
    evs = farm.events(resp.id)  # n=1: the job id is the completion id
    assert [e.seq for e in evs] == list(range(len(expected_ids)))
    assert evs[0].worker == "xpu" and {e.worker for e in evs[1:]} == {"cpu"}, (
        "prefill here, decode there"
    )


def test_greedy_choices_of_one_prefill_job_all_equal_the_single_run(farm, reference):
    """n=3 is one prefill job: the prompt prefilled once, three sequences forked from it (two
    through the prefix cache), each handed off to the decoder with the prompt and parameters
    stored once: every choice is the one greedy answer."""
    expected_text, expected_ids = reference(MESSAGES, 12)
    resp = farm.client(timeout=120).chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, n=3
    )
    assert [c.message.content for c in resp.choices] == [expected_text] * 3
    assert resp.usage.completion_tokens == 3 * len(expected_ids)
    for i in range(3):
        evs = farm.events(f"{resp.id}-{i}")
        assert [e.seq for e in evs] == list(range(len(expected_ids))), "every token once"
        assert evs[0].worker == "xpu" and {e.worker for e in evs[1:]} == {"cpu"}


def test_first_token_arrives_before_the_decode_worker_takes_the_job(farm, reference):
    expected_text, _ = reference(MESSAGES, 16)
    farm.procs["cpu"].send_signal(signal.SIGSTOP)  # the decode worker cannot take anything now
    # ...once the blocking read it may be in has timed out in Redis (block_ms, 100 ms): until
    # then Redis still hands it entries, which a frozen process holds as pending. With the
    # fused prefill the handoff can come within those 100 ms.
    time.sleep(0.5)
    try:
        stream = farm.client(timeout=120).chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0, stream=True
        )
        chunks = iter(stream)
        text = ""
        while not text:
            chunk = next(chunks)
            text += chunk.choices[0].delta.content or "" if chunk.choices else ""
        # The first token is here while the decode worker is frozen: the decode job (queued
        # right after the first token was published) waits, untaken, in its stream.
        end = time.monotonic() + 10
        while farm.r.xlen(KEYS.decode_stream("cpu")) == 0 and time.monotonic() < end:
            time.sleep(0.05)
        assert farm.r.xlen(KEYS.decode_stream("cpu")) == 1
        assert farm.r.xpending(KEYS.decode_stream("cpu"), KEYS.decode_group)["pending"] == 0
    finally:
        farm.procs["cpu"].send_signal(signal.SIGCONT)
    for chunk in chunks:
        text += (chunk.choices[0].delta.content or "") if chunk.choices else ""
    assert text == expected_text


def test_streaming_usage_and_stop_strings(farm, reference):
    expected_text, expected_ids = reference(MESSAGES, 20)
    stream = farm.client(timeout=120).chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected_text
    assert chunks[-1].usage.completion_tokens == len(expected_ids)
    stop = expected_text[5:9]
    resp = farm.client(timeout=120).chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=20, temperature=0, stop=[stop]
    )
    assert resp.choices[0].message.content == expected_text[: expected_text.index(stop)]
    assert resp.choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible_across_the_farm(farm):
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0.9, seed=1234, n=2)
    a = farm.client(timeout=120).chat.completions.create(**kw)
    b = farm.client(timeout=120).chat.completions.create(**kw)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert a.choices[0].message.content != a.choices[1].message.content


def test_client_disconnect_cancels_and_frees_everything(farm):
    with httpx.stream(
        "POST",
        farm.url() + "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": MESSAGES,
            "max_tokens": 400,
            "stream": True,
            "temperature": 0.7,
        },
        timeout=60,
    ) as resp:
        assert resp.status_code == 200
        rid = None
        for i, line in enumerate(resp.iter_lines()):
            if line.startswith("id: "):
                rid = line[4:].rsplit(":", 1)[0]  # n=1: the job id is the completion id
            if i > 8:
                break  # leave mid-stream
    streams = (KEYS.prefill_stream, KEYS.decode_stream("cpu"), KEYS.decode_stream("xpu"))
    time.sleep(1.5)  # the gateway waits disconnect_grace (0.5 s) for a resume before it cancels
    end = time.monotonic() + 20
    while time.monotonic() < end:
        workers = [farm.r.hgetall(KEYS.worker(w)) for w in ("xpu", "cpu")]
        busy = sum(int(w.get(b"running", 0)) + int(w.get(b"waiting", 0)) for w in workers)
        left = sum(farm.r.xlen(s) for s in streams)
        if busy == 0 and left == 0 and KVStore(farm.r).stats() == (0, 0):
            break
        time.sleep(0.5)
    assert busy == 0, "generation stopped on every worker"
    assert KVStore(farm.r).stats() == (0, 0), "no KV lease left behind"
    for stream in streams:
        assert farm.r.xlen(stream) == 0, f"{stream} left entries behind: {farm.r.xrange(stream)}"
    n = farm.r.xlen(KEYS.output_stream(rid))
    time.sleep(1)
    assert farm.r.xlen(KEYS.output_stream(rid)) == n < 400, "no token after the cancel"
