"""Issue 28's done-when on vLLM (`make test-vllm`): constrained answers served through the farm
with vLLM as the xPU engine equal, token by token, what vLLM's own offline API (`LLM.generate`)
gives for the same prompt with the same structured-outputs parameters, written here as a vLLM
user writes them (a JSON schema, a choice, a regex), all greedy, on the same float32 folder and
the engine config the farm gives vLLM: the guidance backend (llguidance, the grammar engine of
our own engines) and JSON without free whitespace (the farm's default).

The farm's requests come through the official openai client: `response_format` json_schema
and vLLM's `structured_outputs` extension in `extra_body`. Then a CPU decode worker joins
(`decode_device: cpu`): vLLM prefills and samples the first constrained token, the constraint
travels with the KV handoff, and our engine decodes the rest under llguidance's mask. Greedy
over the same float32 math under the same constraint, it must give the same tokens again."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

from syshax.broker.keys import DEVICE_CLASSES, KEYS  # noqa: E402

XPU, CPU = DEVICE_CLASSES

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["city", "population"],
    "additionalProperties": False,
}
CHOICE = ["yes", "no", "maybe"]
REGEX = r"[0-9]{3}-[0-9]{4}"
MAX_TOKENS = 40

# (question, the farm request's structured fields, vLLM's StructuredOutputsParams arguments)
CASES = [
    (
        "What is the largest city of France and its population? Answer in JSON.",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "city", "schema": SCHEMA},
            }
        },  # fmt: skip
        {"json": SCHEMA},
    ),
    (
        "Is Paris the capital of France?",
        {"extra_body": {"structured_outputs": {"choice": CHOICE}}},
        {"choice": CHOICE},
    ),
    (
        "Make up a phone number.",
        {"extra_body": {"structured_outputs": {"regex": REGEX}}},
        {"regex": REGEX},
    ),
]

OFFLINE = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.sampling_params import StructuredOutputsParams
folder, cases = sys.argv[1], json.loads(sys.argv[2])
# The farm's vLLM engine config: llguidance, JSON without free whitespace (an engine setting)
llm = LLM(model=folder, dtype="float32", max_model_len=512, enforce_eager=True, structured_outputs_config={"backend": "guidance", "disable_any_whitespace": True})
out = []
for prompt, so, max_tokens in cases:  # one at a time, as the farm's requests ran
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_outputs=StructuredOutputsParams(**so))
    out.append(list(llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].token_ids))
print("TOKENS " + json.dumps(out))
"""


def _ask(farm, question: str, fields: dict) -> tuple[list[int], list[str], str]:
    """One greedy streamed chat through the gateway: (tokens, worker of each token, text)."""
    client = farm.client(timeout=180)
    stream = client.chat.completions.create(
        model=farm.cfg.model_id,
        messages=[{"role": "user", "content": question}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        **fields,
    )
    rid, parts = "", []
    for chunk in stream:
        rid = chunk.id
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
    events = farm.events(rid)
    assert events and events[-1].finish_reason and not events[-1].error, events[-1:]
    return [e.token_id for e in events], [e.worker for e in events], "".join(parts)


def _prompt_ids(farm, question: str) -> list[int]:
    """The prompt the farm built for the chat (its /tokenize runs the same chat template)."""
    body = {"messages": [{"role": "user", "content": question}]}
    reply = httpx.post(farm.url() + "/tokenize", json=body, timeout=30)
    assert reply.status_code == 200, reply.text
    return reply.json()["tokens"]


def _offline(hf_folder, cases: list) -> list[list[int]]:
    proc = subprocess.run([sys.executable, "-c", OFFLINE, str(hf_folder), json.dumps(cases)], capture_output=True, text=True, timeout=600)  # fmt: skip
    lines = [x for x in proc.stdout.splitlines() if x.startswith("TOKENS ")]
    assert lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("TOKENS ") :])


def _check_answer(kind: dict, text: str) -> None:
    """The answer is what its constraint allows (so a pass is not two equal wrong answers)."""
    if "json" in kind:
        assert set(json.loads(text)) == {"city", "population"}, text
    elif "choice" in kind:
        assert text in CHOICE, text
    else:
        import re

        assert re.fullmatch(REGEX, text), text


def test_constrained_answers_through_the_farm_equal_vllm_offline(proc_farm, hf_folder):
    farm = proc_farm(max_model_len=512, xpu_max_batch_size=4, decode_device="cpu")
    farm.cfg.model = str(hf_folder)
    farm.cfg.xpu.vllm.dtype = "float32"
    farm.cfg.xpu.vllm.enforce_eager = True
    farm.cfg.xpu.vllm.cpu_kv_cache_gib = 1.0
    farm.cfg.xpu.engine = "vllm"
    farm.save_config()
    farm.start_gateway()
    # engine None: the xPU class follows the config's engine (vllm)
    farm.start_worker("xpu", "prefill,decode", XPU, engine=None, args=("--port", "0"))
    farm.wait_registered(["xpu"], timeout=300)
    farm.wait_healthy()

    # No CPU decoder alive: vLLM decodes every request under its own structured outputs.
    served = [_ask(farm, question, fields) for question, fields, _ in CASES]
    for (_, _, so), (_, workers, text) in zip(CASES, served, strict=True):
        assert set(workers) == {"xpu"}, workers
        _check_answer(so, text)
    cases = [[_prompt_ids(farm, q), so, MAX_TOKENS] for q, _, so in CASES]
    offline = _offline(hf_folder, cases)
    assert [tokens for tokens, _, _ in served] == offline

    # A CPU decoder joins: vLLM prefills and samples the first token, our engine continues
    # under the same constraint (rebuilt from the spec and the token so far).
    cpu_args = ("--device", "cpu", "--threads", "1", "--port", "0")
    farm.start_worker("cpu", "decode", CPU, engine="native", args=cpu_args, env={"SYSHAX_QUANTIZE": "none"})  # fmt: skip
    farm.wait_registered(["cpu"], timeout=180)
    time.sleep(0.5)  # the xPU worker's view of its peers is cached for 0.25 s
    for (question, fields, _), (tokens, _, text) in zip(CASES, served, strict=True):
        got, workers, got_text = _ask(farm, question, fields)
        if len(got) > 1:  # a one-token answer (a choice) ends on vLLM: nothing to hand off
            assert workers[0] == "xpu" and set(workers[1:]) == {"cpu"}, workers
        assert (got, got_text) == (tokens, text)
    log = [d.decode() for d in farm.r.lrange(KEYS.dispatch_log, 0, -1)]
    assert sum(" cpu [decode_device] " in d for d in log) >= 2, log
    left = farm.wait_quiescent()
    assert left["leases"] == (0, 0) and left["entries"] == 0 and left["pending"] == 0, left
