"""The whole farm with the real model: real worker processes, a real Redis, the real gateway,
the official `openai` client. The xPU worker only prefills and the CPU worker only decodes,
so every request here crosses processes through a KV handoff."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import redis
from syshax.broker.embedded import free_port
from syshax.broker.keys import KEYS
from syshax.broker.kv_store import KVStore
from syshax.broker.schemas import TokenEvent
from syshax.shared.config import Config, save_config

openai = pytest.importorskip("openai")

MODEL = "SmolLM2-135M-Instruct"
MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow."}]
MAX_LEN = 512


class Farm:
    def __init__(self, tmp: Path, redis_url: str, cpu_env: dict[str, str] | None = None):
        cfg = Config()
        cfg.redis.url = redis_url
        cfg.conductor.port = free_port()
        cfg.max_model_len = MAX_LEN
        cfg.request_timeout = 120
        cfg.gpu.max_batch_size = 4
        cfg.cpu_max_batch_size = 4
        self.config = tmp / "config.yaml"
        save_config(cfg, self.config)
        self.base_url = f"http://127.0.0.1:{cfg.conductor.port}/v1"
        self.r = redis.Redis.from_url(redis_url)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        cli = [sys.executable, "-m", "syshax.cli"]
        common = ["--config", str(self.config)]
        self.procs = {
            "gateway": subprocess.Popen(cli + ["gateway"] + common, env=env),
            "xpu": subprocess.Popen(
                cli
                + [
                    "worker",
                    "--roles",
                    "prefill",
                    "--device-class",
                    "gpu",
                    "--id",
                    "xpu",
                    "--threads",
                    "1",
                ]
                + common,
                env=env,
            ),
            "cpu": subprocess.Popen(
                cli
                + [
                    "worker",
                    "--roles",
                    "decode",
                    "--device",
                    "cpu",
                    "--id",
                    "cpu",
                    "--threads",
                    "1",
                ]
                + common,
                env={**env, **(cpu_env or {})},
            ),
        }
        self.client = openai.OpenAI(base_url=self.base_url, api_key="unused", timeout=120)

    def wait_healthy(self, timeout: float = 180) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for name, p in self.procs.items():
                assert p.poll() is None, f"{name} exited with {p.returncode}"
            try:
                if (
                    httpx.get(self.base_url.removesuffix("/v1") + "/health", timeout=2).status_code
                    == 200
                ):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise AssertionError("farm did not become healthy")

    def events(self, request_id: str) -> list[TokenEvent]:
        return [
            TokenEvent.unpack(f[b"e"]) for _, f in self.r.xrange(KEYS.output_stream(request_id))
        ]

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


@pytest.fixture(scope="module")
def farm(tmp_path_factory, redis_server):
    redis.Redis.from_url(redis_server.url).flushall()
    f = Farm(tmp_path_factory.mktemp("farm"), redis_server.url)
    try:
        f.wait_healthy()
        yield f
    finally:
        f.stop()


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
    resp = farm.client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0
    )
    assert resp.choices[0].message.content == expected_text
    assert resp.usage.completion_tokens == len(expected_ids)
    evs = farm.events(resp.id)  # n=1: the job id is the completion id
    assert [e.seq for e in evs] == list(range(len(expected_ids)))
    assert evs[0].worker == "xpu" and {e.worker for e in evs[1:]} == {"cpu"}, (
        "prefill here, decode there"
    )


def test_first_token_arrives_before_the_decode_worker_takes_the_job(farm, reference):
    expected_text, _ = reference(MESSAGES, 16)
    farm.procs["cpu"].send_signal(signal.SIGSTOP)  # the decode worker cannot take anything now
    # ...once the blocking read it may be in has timed out in Redis (block_ms, 100 ms): until
    # then Redis still hands it entries, which a frozen process holds as pending. With the
    # fused prefill the handoff can come within those 100 ms.
    time.sleep(0.5)
    try:
        stream = farm.client.chat.completions.create(
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
    stream = farm.client.chat.completions.create(
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
    resp = farm.client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=20, temperature=0, stop=[stop]
    )
    assert resp.choices[0].message.content == expected_text[: expected_text.index(stop)]
    assert resp.choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible_across_the_farm(farm):
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0.9, seed=1234, n=2)
    a = farm.client.chat.completions.create(**kw)
    b = farm.client.chat.completions.create(**kw)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert a.choices[0].message.content != a.choices[1].message.content


def test_client_disconnect_cancels_and_frees_everything(farm):
    with httpx.stream(
        "POST",
        farm.base_url + "/chat/completions",
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
    streams = (KEYS.prefill_stream, KEYS.decode_stream("cpu"), KEYS.decode_stream("gpu"))
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
