"""The farm with a requantizing CPU decode worker (SYSHAX_QUANTIZE=q4_0, INFERENCE_OP_MODE=fused)
beside an xPU-role worker on this GPU-less host, which runs the default rule (the GGUF's own
Q4_1 blocks, fused step): the xPU worker prefills, the KV moves, the CPU worker decodes with
Q4_0 weights. The stream must be exactly what the same handoff gives in-process."""

from __future__ import annotations

import pytest
from syshax.shared.sampling import SamplingParams

from ...test_farm_e2e import MESSAGES, MODEL, local_engine, model_farm

N = 20


@pytest.fixture(scope="module")
def kernel_farm(tmp_path_factory):
    env = {"SYSHAX_QUANTIZE": "q4_0", "INFERENCE_OP_MODE": "fused"}
    with model_farm(tmp_path_factory.mktemp("kfarm"), cpu_env=env) as f:
        yield f


def _handoff_reference() -> tuple[str, list[int]]:
    params = SamplingParams(max_tokens=N, temperature=0.0)
    xpu, cpu = local_engine(), local_engine("q4_0")
    ids = xpu.tokenizer.encode_chat(MESSAGES)
    xpu.add_request("r", ids, params)
    (first,) = xpu.step()
    blob = xpu.export_kv("r")
    cpu.import_kv("r", blob, ids, [first.token_id], params)
    outs = [first]
    while not outs[-1].finished:
        outs += cpu.step()
    return "".join(o.text for o in outs), [o.token_id for o in outs]


def test_quantized_fused_cpu_decode_in_the_farm(kernel_farm):
    text, ids = _handoff_reference()
    stream = kernel_farm.client(timeout=120).chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=N,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    got, usage, rid = "", None, None
    for chunk in stream:
        rid = chunk.id
        if chunk.choices:
            got += chunk.choices[0].delta.content or ""
        if chunk.usage:
            usage = chunk.usage
    assert got == text
    assert usage is not None and usage.completion_tokens == len(ids)
    evs = kernel_farm.events(rid)
    assert [e.seq for e in evs] == list(range(len(ids)))
    assert evs[0].worker == "xpu" and {e.worker for e in evs[1:]} == {"cpu"}
