"""SmolLM2-135M-Instruct from its GGUF: our greedy output equals transformers' on the same
dequantized weights, and the chat prompt goes through the model's own template."""

from __future__ import annotations

import pytest
import torch
from syshax.shared.default_model import default_model_path
from syshax.shared.sampling import SamplingParams
from syshax.workers.engine.engine import Engine

MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
N_TOKENS = 32


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(None, max_model_len=512, max_num_seqs=2, progress=False)


def test_greedy_chat_equals_transformers(engine):
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    prompt = engine.tokenizer.encode_chat(MESSAGES)
    assert prompt[:1] == [engine.tokenizer.token_to_id("<|im_start|>")]
    ours = [
        o.token_id
        for o in engine.generate(
            prompt, SamplingParams(max_tokens=N_TOKENS, temperature=0, ignore_eos=True)
        )
    ]
    ref_model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    ref = ref_model.generate(
        torch.tensor([prompt]),
        max_new_tokens=N_TOKENS,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )[0, len(prompt) :].tolist()
    assert ours == ref
    assert "Paris" in engine.tokenizer.decode(ours)


def test_stop_string_and_eos(engine):
    prompt = engine.tokenizer.encode_chat(MESSAGES)
    outs = list(engine.generate(prompt, SamplingParams(max_tokens=64, temperature=0)))
    full = "".join(o.text for o in outs)
    assert outs[-1].finish_reason == "stop" and outs[-1].token_id in engine.eos_token_ids
    assert "<|im_end|>" not in full and "Paris" in full
    cut = full.index("Paris") + 2  # stop in the middle of a word: spans a token boundary
    stop = full[cut - 3 : cut]
    outs = list(
        engine.generate(
            prompt, SamplingParams(max_tokens=64, temperature=0, stop=[stop]), request_id="s"
        )
    )
    text = "".join(o.text for o in outs)
    assert outs[-1].finish_reason == "stop"
    assert text == full[: full.index(stop)]


def test_utf8_prompts_round_trip(engine):
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "你好，世界 🌍🚀 — café"}])
    outs = list(
        engine.generate(
            prompt, SamplingParams(max_tokens=24, temperature=0.8, seed=3), request_id="u"
        )
    )
    text = "".join(o.text for o in outs)
    assert "\ufffd" not in text
    ids = [o.token_id for o in outs if o.token_id not in engine.eos_token_ids]
    assert text == engine.tokenizer.decode(ids)
