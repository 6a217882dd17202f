"""hf_export: sizes and shards, an untied tiny Qwen2 GGUF (with a tokenizer) that transformers
loads with every weight in place, shards with an index, --force, and the errors."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from syshax.shared.gguf_tokenizer import byte_map
from syshax.shared.weights_digest import LINEAGE_FILE, folder_digest, weights_digest
from syshax.workers.engine import hf_weights
from syshax.workers.engine.errors import ExportError, ModelLoadError
from syshax.workers.engine.gguf_weights import open_gguf
from syshax.workers.engine.hf_export import export_hf, parse_size, plan_shards

from .test_gguf_weights import META, _layer, _rand, _write

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENS = SPECIALS + sorted(byte_map().values()) + ["Ġt"]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"


def test_parse_size():
    assert parse_size("4GB") == 4 * 10**9 and parse_size("500mb") == 500 * 10**6
    assert parse_size("2GiB") == 2 * 2**30 and parse_size("1.5G") == 1_500_000_000
    assert parse_size("1234") == 1234 and parse_size(77) == 77
    for bad in ("", "4XB", "-1GB", "0", "GB"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_plan_shards_keeps_order_and_gives_big_tensors_their_own():
    sizes = [("a", 40), ("b", 50), ("c", 20), ("d", 300), ("e", 10)]
    assert plan_shards(sizes, 100) == [["a", "b"], ["c"], ["d"], ["e"]]
    assert plan_shards(sizes, 10**9) == [["a", "b", "c", "d", "e"]]


def _tiny_qwen2(path: Path, big: float | None = None) -> Path:
    """A one-layer Qwen2 GGUF with an untied output.weight and a byte-level BPE tokenizer."""
    vocab = len(TOKENS)
    tensors = _layer(seed=5)
    tensors["token_embd.weight"] = _rand(vocab, 32, seed=30)
    tensors["output.weight"] = _rand(vocab, 32, seed=31)
    tensors["blk.0.attn_q.bias"] = _rand(32, seed=32)
    tensors["blk.0.attn_k.bias"] = _rand(16, seed=33)
    tensors["blk.0.attn_v.bias"] = _rand(16, seed=34)
    tensors["blk.0.ffn_up.weight"] = (
        gguf.GGMLQuantizationType.Q8_0,
        tensors["blk.0.ffn_up.weight"],
    )
    if big is not None:
        tensors["blk.0.ffn_norm.weight"] = np.full(32, big, dtype=np.float32)
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_name("tiny qwen2")
    for key, value in META.items():
        if isinstance(value, float):
            w.add_float32(f"qwen2.{key}", value)
        else:
            w.add_uint32(f"qwen2.{key}", value)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(TOKENS)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(TOKENS) - len(SPECIALS)))
    w.add_token_merges(["Ġ t"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(TEMPLATE)
    for name, value in tensors.items():
        if isinstance(value, tuple):
            qtype, arr = value
            w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_untied_qwen2_loads_in_transformers_with_every_weight(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = _tiny_qwen2(tmp_path / "tiny.gguf")
    out = tmp_path / "hf"
    result = export_hf(path, out, dtype="float32", progress=False)
    assert result.shards == 1 and (out / "model.safetensors").is_file()
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["tie_word_embeddings"] is False
    model, info = AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    gg = open_gguf(path)
    state = model.state_dict()
    assert "lm_head.weight" in gg.tensors
    for name in gg.tensors:
        assert torch.equal(state[name], gg.float(name)), name
    tok = AutoTokenizer.from_pretrained(out)
    messages = [{"role": "user", "content": "tt t"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=False)["input_ids"]
    assert list(ids) == [1, TOKENS.index("t"), TOKENS.index("t"), TOKENS.index("Ġt"), 2]


def test_the_folder_records_and_returns_its_source_digest(tmp_path):
    """The folder's weights_digest is the GGUF's (recorded in syshax.json), so an engine on
    the folder and one on the GGUF exchange KV; weights changed since give their own."""
    path = _tiny_qwen2(tmp_path / "tiny.gguf")
    source = weights_digest(path)
    out = tmp_path / "hf"
    result = export_hf(path, out, dtype="float32", shard_size=8192, progress=False)
    assert result.shards > 1 and result.weights_digest == source
    record = json.loads((out / LINEAGE_FILE).read_text())
    assert record == {
        "weights_digest": source,
        "source": "tiny.gguf",
        "folder_digest": folder_digest(out),
    }
    assert weights_digest(out) == source
    other = _tiny_qwen2(tmp_path / "other.gguf", big=3.0)  # same shape, one tensor changed
    assert weights_digest(other) != source
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    shard = out / weight_map["model.layers.0.post_attention_layernorm.weight"]
    tensors = load_file(shard)
    for name in tensors:
        tensors[name] = tensors[name] + 1
    save_file(tensors, shard)  # a fine-tune saved over the folder
    assert weights_digest(out) == folder_digest(out) != source


def test_shards_with_index_and_force_replaces_a_model_folder(tmp_path):
    path = _tiny_qwen2(tmp_path / "tiny.gguf")
    out = tmp_path / "hf"
    out.mkdir()
    for stale in ("model.safetensors", "chat_template.jinja", "notes.txt"):
        (out / stale).write_text("old")
    with pytest.raises(ExportError, match="not empty"):
        export_hf(path, out, progress=False)
    result = export_hf(path, out, dtype="bfloat16", shard_size=8192, force=True, progress=False)
    names = sorted(p.name for p in out.iterdir())
    n = result.shards
    shards = [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert n > 2 and names == sorted(
        [*shards, "model.safetensors.index.json", "notes.txt", "config.json"]
        + ["generation_config.json", "tokenizer.json", "tokenizer_config.json"]
        + ["special_tokens_map.json", "syshax.json"]
    )
    index = json.loads((out / "model.safetensors.index.json").read_text())
    gg = open_gguf(path)
    assert set(index["weight_map"]) == set(gg.tensors)
    assert index["metadata"]["total_size"] == result.weight_bytes
    assert hf_weights.safetensors_files(out) == [out / s for s in shards]
    for shard in shards:
        for name, tensor in load_file(out / shard).items():
            assert index["weight_map"][name] == shard
            assert tensor.dtype == torch.bfloat16
            assert torch.equal(tensor, gg.float(name, torch.bfloat16)), name


def test_float16_overflow_and_no_tokenizer_are_errors(tmp_path):
    path = _tiny_qwen2(tmp_path / "big.gguf", big=1e6)
    with pytest.raises(ExportError, match="beyond float16's range"):
        export_hf(path, tmp_path / "f16", dtype="float16", progress=False)
    assert not (tmp_path / "f16" / "config.json").exists()
    export_hf(path, tmp_path / "bf16", dtype="bfloat16", progress=False)  # bf16 has the range

    plain = _write(tmp_path / "plain.gguf", "llama", META, _layer())
    with pytest.raises(ModelLoadError, match="has no tokenizer"):
        export_hf(plain, tmp_path / "none", progress=False)
    assert not (tmp_path / "none").exists()
    with pytest.raises(ValueError, match="dtype"):
        export_hf(path, tmp_path / "x", dtype="int8", progress=False)
