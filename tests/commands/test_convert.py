"""`syshax convert`: the bundled SmolLM2 GGUF as a Hugging Face folder, converted once (float32)
and loaded by transformers and by our engine; both generate what our engine generates from the
GGUF, and the folder's tokenizer encodes and templates like the GGUF's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from syshax.shared.default_model import default_model_path
from syshax.shared.sampling import SamplingParams
from syshax.shared.tokenizer import Tokenizer
from syshax.shared.weights_digest import weights_digest
from syshax.workers.engine.engine import Engine
from syshax.workers.engine.gguf_weights import open_gguf

from syshax.cli import build_parser, main

N_TOKENS = 16
MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("convert") / "smollm2"
    assert main(["convert", "default", str(out), "--dtype", "float32", "--no-progress"]) == 0
    return out


@pytest.fixture(scope="module")
def gguf_engine() -> Engine:
    # quantize=None: the float PyTorch path, the same dequantized weights the folder holds.
    return Engine(None, max_model_len=256, max_num_seqs=1, progress=False)


@pytest.fixture(scope="module")
def gguf_tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(default_model_path())


def _greedy(engine: Engine, prompt: list[int]) -> list[int]:
    params = SamplingParams(max_tokens=N_TOKENS, temperature=0, ignore_eos=True)
    return [o.token_id for o in engine.generate(prompt, params)]


def test_folder_has_hf_files(folder: Path) -> None:
    names = {p.name for p in folder.iterdir()}
    assert names == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "special_tokens_map.json",
        "syshax.json",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    # The folder declares its lineage: its weights digest is the GGUF's, so a worker on it
    # (vLLM) and one on the GGUF exchange KV (docs/vllm.md).
    assert weights_digest(folder) == weights_digest(default_model_path())
    assert json.loads((folder / "syshax.json").read_text())["source"] == default_model_path().name
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["torch_dtype"] == "float32"
    assert config["tie_word_embeddings"] is True
    gguf = open_gguf(default_model_path())
    with safe_open(str(folder / "model.safetensors"), framework="pt") as st:
        keys = set(st.keys())
        assert st.metadata() == {"format": "pt"}
        name = "model.layers.3.self_attn.k_proj.weight"  # llama.cpp's row order undone
        assert torch.equal(st.get_tensor(name), gguf.float(name))
    assert keys == set(gguf.tensors) and "lm_head.weight" not in keys  # tied: not written
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": [2, 0], "pad_token_id": 2}
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    assert tok_config["chat_template"] == gguf.metadata["tokenizer.chat_template"]
    assert (tok_config["bos_token"], tok_config["eos_token"]) == ("<|im_start|>", "<|im_end|>")


def test_transformers_generates_like_our_engine_on_the_gguf(folder, gguf_engine):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(folder)
    prompt = list(hf_tok.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"])
    assert prompt == gguf_engine.tokenizer.encode_chat(MESSAGES)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # N_TOKENS tokens, as ignore_eos does
    ref = model.generate(
        torch.tensor([prompt]), max_new_tokens=N_TOKENS, do_sample=False, pad_token_id=0
    )[0, len(prompt) :].tolist()
    assert ref == _greedy(gguf_engine, prompt)


def test_our_engine_loads_the_folder(folder, gguf_engine):
    # Served under the GGUF engine's name (the farm's `served_model_name`), as docs/vllm.md's
    # vLLM-on-the-folder + CPU-worker-on-the-GGUF farm does.
    served = gguf_engine.kv_identity.served_model
    engine = Engine(folder, max_model_len=256, max_num_seqs=1, progress=False, served_model=served)
    prompt = engine.tokenizer.encode_chat(MESSAGES)
    assert prompt == gguf_engine.tokenizer.encode_chat(MESSAGES)
    assert engine.tokenizer.eos_token_ids == gguf_engine.tokenizer.eos_token_ids
    assert engine.config.fingerprint() == gguf_engine.config.fingerprint()
    expected = _greedy(engine, prompt)
    assert expected == _greedy(gguf_engine, prompt)
    # The folder's KV continues on the GGUF: the same weights identity (syshax.json).
    assert engine.kv_identity == gguf_engine.kv_identity
    params = SamplingParams(max_tokens=N_TOKENS, temperature=0, ignore_eos=True)
    engine.add_request("kv", prompt, params)
    first = [o.token_id for o in engine.step()]
    gguf_engine.import_kv("kv", engine.export_kv("kv"), prompt, first, params)
    rest = []
    while gguf_engine.has_unfinished():
        rest += [o.token_id for o in gguf_engine.step()]
    assert first + rest == expected


TEXTS = [
    "Hello world! It's 2024-05-06, isn't it?",
    "  café — naïve 你好，世界 🌍🚀\n\n\ttabs",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "x<|im_end|>y 12345",
]
CONVERSATIONS = [
    MESSAGES,
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi! 👋"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Tschüss"},
    ],
]


def test_tokenizer_matches_the_gguf_tokenizer(folder, gguf_tokenizer):
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(folder)
    ours = Tokenizer.from_hf_folder(folder)
    for text in TEXTS:
        ids = gguf_tokenizer.encode(text)
        assert hf_tok.encode(text) == ids, text
        assert ours.encode(text) == ids, text
        assert hf_tok.decode(ids, skip_special_tokens=True) == gguf_tokenizer.decode(ids)
    for conversation in CONVERSATIONS:
        for gen in (True, False):
            expected = gguf_tokenizer.encode_chat(conversation, add_generation_prompt=gen)
            got = hf_tok.apply_chat_template(conversation, add_generation_prompt=gen)
            assert list(got["input_ids"]) == expected
            assert ours.encode_chat(conversation, add_generation_prompt=gen) == expected
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id, hf_tok.pad_token_id) == (1, 2, 2)


def test_missing_and_bad_files(tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    assert main(["convert", str(tmp_path / "nope.gguf"), str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("syshax convert: error: ") and "nope.gguf: no such file" in err
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    assert main(["convert", str(bad), str(out)]) == 2
    assert "not a readable GGUF file" in capsys.readouterr().err
    assert not out.exists()  # nothing written for a file that cannot be converted


def test_non_empty_outdir_needs_force(tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["convert", "default", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"{out}: folder is not empty" in err and "--force" in err
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_help_says_a_quantized_file_is_dequantized(capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["convert", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "dequantized: the folder is larger than the file" in text
    assert "--dtype {bfloat16,float16,float32}" in text and "--shard-size" in text
