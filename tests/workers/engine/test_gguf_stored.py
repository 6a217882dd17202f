"""A GGUF loads for the CPU kernels with its blocks used as stored (workers/engine/loader.py,
workers/cpu/gguf_load.py): no float copy of a quantized tensor, a Q4_K_M mixture (Q4_K q/k
next to a Q6_K v in one fused matrix) as stacked parts, bounded peak memory, and clear errors
before anything loads for a model that cannot fit or a tensor type nothing can read."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from syshax.workers.cpu import lib
from syshax.workers.cpu.quantized import QuantEmbedding, QuantLinear
from syshax.workers.engine import memory
from syshax.workers.engine.engine import Engine
from syshax.workers.engine.errors import ModelLoadError
from syshax.workers.engine.gguf_rope import unpermute_qk
from syshax.workers.engine.loader import load_model

from ..cpu.test_gguf_blocks import greedy_on_both_paths
from ..cpu.test_kquants import random_blocks
from .test_gguf_weights import _write

HIDDEN, FFN, HEADS, KV, HEAD_DIM, VOCAB, LAYERS = 256, 512, 4, 2, 64, 96, 2


def _meta(hidden: int, ffn: int, heads: int) -> dict:
    return {
        "block_count": LAYERS,
        "context_length": 512,
        "embedding_length": hidden,
        "feed_forward_length": ffn,
        "attention.head_count": heads,
        "attention.head_count_kv": KV,
        "rope.freq_base": 10000.0,
        "attention.layer_norm_rms_epsilon": 1e-5,
    }


def _blocks(qtype: T, rows: int, cols: int, seed: int) -> np.ndarray:
    if qtype == T.Q8_1:  # no kernel or gguf-py reader: only its size matters here
        return np.zeros((rows, cols // 32 * 40), dtype=np.uint8)
    return random_blocks(int(qtype), rows, cols, seed).numpy()


def q4_k_m_file(
    tmp_path,
    odd_type: T = T.Q6_K,
    name: str = "tiny.Q4_K_M.gguf",
    dims: tuple[int, int, int, int] = (HIDDEN, FFN, HEADS, VOCAB),
):
    """A llama GGUF laid out as llama.cpp's Q4_K_M: Q4_K matrices, attn_v of layer 0 and every
    ffn_down in `odd_type`, a tied embedding in Q6_K. `dims`: hidden, FFN, heads, vocabulary.
    Returns (path, tensors as written)."""
    hidden, ffn, heads, vocab = dims
    norm = np.ones(hidden, dtype=np.float32)
    t: dict = {"token_embd.weight": (T.Q6_K, _blocks(T.Q6_K, vocab, hidden, 1))}
    t["output_norm.weight"] = norm
    for i in range(LAYERS):
        b, s = f"blk.{i}.", 10 * (i + 1)
        t[b + "attn_norm.weight"] = norm
        t[b + "ffn_norm.weight"] = norm
        t[b + "attn_q.weight"] = (T.Q4_K, _blocks(T.Q4_K, heads * HEAD_DIM, hidden, s))
        t[b + "attn_k.weight"] = (T.Q4_K, _blocks(T.Q4_K, KV * HEAD_DIM, hidden, s + 1))
        v_type = odd_type if i == 0 else T.Q4_K
        t[b + "attn_v.weight"] = (v_type, _blocks(v_type, KV * HEAD_DIM, hidden, s + 2))
        t[b + "attn_output.weight"] = (T.Q4_K, _blocks(T.Q4_K, hidden, heads * HEAD_DIM, s + 3))
        t[b + "ffn_gate.weight"] = (T.Q4_K, _blocks(T.Q4_K, ffn, hidden, s + 4))
        t[b + "ffn_up.weight"] = (T.Q4_K, _blocks(T.Q4_K, ffn, hidden, s + 5))
        t[b + "ffn_down.weight"] = (odd_type, _blocks(odd_type, hidden, ffn, s + 6))
    return _write(tmp_path / name, "llama", _meta(hidden, ffn, heads), t), t


def _unpacked(module: QuantLinear) -> list[np.ndarray]:
    """Each part's blocks back in GGML row-major form."""
    out = []
    for qtype, rows, off in module.parts:
        end = off + lib.packed_bytes(qtype, rows, module.in_features)
        out.append(lib.unpack(module.blocks[off:end], qtype, rows, module.in_features).numpy())
    return out


def test_stored_plan_keeps_the_files_blocks_and_no_float_weights(tmp_path):
    path, t = q4_k_m_file(tmp_path)
    loaded = load_model(path, max_model_len=64, progress=False, weights="stored")
    net = loaded.model
    assert (loaded.report.from_file, loaded.report.quantized, loaded.report.as_float) == (9, 0, 0)
    # Only norms are float parameters: no projection or embedding was dequantized.
    assert all(p.dim() == 1 for p in net.parameters())
    assert not any(isinstance(m, torch.nn.Linear) for m in net.modules())
    assert isinstance(net.embed_tokens, QuantEmbedding) and net.embed_tokens.qtype == lib.Q6_K
    assert np.array_equal(net.embed_tokens.table.numpy(), t["token_embd.weight"][1])

    qkv0, qkv1 = (layer.self_attn.qkv_proj for layer in net.layers)
    assert [p[0] for p in qkv0.parts] == [lib.Q4_K, lib.Q4_K, lib.Q6_K] and qkv0.qtype == -1
    assert qkv1.qtype == lib.Q4_K
    q, k, v = (t[f"blk.0.attn_{x}.weight"][1] for x in "qkv")
    # The file's bytes, llama.cpp's q/k row permutation undone on whole block rows.
    expected = [unpermute_qk(q, HEADS), unpermute_qk(k, KV), v]
    for ours, theirs in zip(_unpacked(qkv0), expected, strict=True):
        assert np.array_equal(ours, theirs)
    down = net.layers[1].mlp.down_proj
    assert np.array_equal(_unpacked(down)[0], t["blk.1.ffn_down.weight"][1])
    assert net.lm_head.qtype == lib.Q6_K  # tied: the embedding's blocks


def test_stored_plan_equals_the_dequantized_model(tmp_path):
    """Same weights two ways: the kernels on the file's blocks vs float32 PyTorch on gguf-py's
    dequantization. Logits agree within the 8-bit activation rounding."""
    path, _ = q4_k_m_file(tmp_path)
    stored = load_model(path, max_model_len=64, progress=False, weights="stored").model
    floats = load_model(path, max_model_len=64, progress=False).model
    ids = torch.tensor([3, 17, 42, 5, 77, 1])
    assert torch.equal(stored.embed_tokens(ids), floats.embed_tokens(ids))
    x = torch.randn(5, HIDDEN)
    for ours, ref in (
        (stored.layers[0].self_attn.qkv_proj, floats.layers[0].self_attn.qkv_proj),
        (stored.lm_head, floats.lm_head),
    ):
        got, want = ours(x), ref(x)
        assert torch.allclose(got, want, rtol=0, atol=0.02 * want.abs().max().item())


def test_q4_k_m_mixture_is_greedy_equal_between_fused_and_pytorch_paths(tmp_path):
    path, _ = q4_k_m_file(tmp_path)
    outs = greedy_on_both_paths(path, "stored", [1, 5, 9, 12, 40], 16, kv_dtype="float32")
    assert len(outs[0]) == 16 and all(0 <= t < VOCAB for t in outs[0])
    assert outs[0] == outs[1]


def test_requantization_plan_converts_other_types_one_at_a_time(tmp_path):
    path, _ = q4_k_m_file(tmp_path)
    loaded = load_model(path, max_model_len=64, progress=False, weights="q8_0")
    assert loaded.report.quantized == 9 and loaded.report.from_file == 0
    assert {m.qtype for m in loaded.model.modules() if isinstance(m, QuantLinear)} == {lib.Q8_0}


def test_a_model_too_large_for_memory_fails_before_loading(tmp_path, monkeypatch):
    path, _ = q4_k_m_file(tmp_path)
    monkeypatch.setattr(memory, "available_bytes", lambda: 64 * 2**20)
    with pytest.raises(ModelLoadError, match=r"needs about .* GiB .* only 0\.1 GiB is available"):
        Engine(path, max_model_len=64, load_tokenizer=False, progress=False, quantize="stored")


def test_the_memory_estimate_counts_stored_blocks_and_the_kv_cache(tmp_path):
    path, t = q4_k_m_file(tmp_path)
    blocks = sum(v[1].nbytes for v in t.values() if isinstance(v, tuple))
    norms = sum(v.nbytes for v in t.values() if not isinstance(v, tuple))
    from syshax.workers.engine.gguf_weights import open_gguf

    gg = open_gguf(path)
    assert memory.gguf_weight_bytes(gg.tensors.values(), "stored", 4, lib.NATIVE_TYPES) == (
        blocks + norms
    )
    as_float = memory.gguf_weight_bytes(gg.tensors.values(), None, 4, lib.NATIVE_TYPES)
    assert as_float > 5 * blocks  # float32 is ~7x a 4.5-6.6 bit block


def test_an_unreadable_tensor_type_is_refused_before_loading(tmp_path):
    path, _ = q4_k_m_file(tmp_path, odd_type=T.Q8_1, name="tiny.q8_1.gguf")
    for weights in (None, "stored"):
        with pytest.raises(ModelLoadError, match="Q8_1 cannot be loaded"):
            load_model(path, max_model_len=64, progress=False, weights=weights)


_PEAK = textwrap.dedent(
    """
    import sys
    from syshax.workers.cpu import lib
    from syshax.workers.engine.loader import load_model

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024

    lib.load()
    # One-time costs (lazy imports of torch's meta-device machinery: ~85 MB) out of the count.
    load_model(sys.argv[1], max_model_len=64, progress=False, weights=sys.argv[3])
    base = status("VmRSS:")
    loaded = load_model(sys.argv[2], max_model_len=64, progress=False, weights=sys.argv[3])
    print(status("VmHWM:") - base, status("VmRSS:") - base)
    """
)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")
def test_peak_memory_of_a_stored_load_is_about_the_file_size(tmp_path):
    """A ~90 MB Q4_K_M-like file: the load's peak RSS stays within 1.25 x the file (+ 16 MiB
    of buffers), where a float32 load would take ~7 x."""
    warm, _ = q4_k_m_file(tmp_path)
    path, _ = q4_k_m_file(tmp_path, name="mid.Q4_K_M.gguf", dims=(2048, 8192, 32, 16384))
    size = path.stat().st_size
    out = subprocess.run(
        [sys.executable, "-c", _PEAK, str(warm), str(path), "stored"],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    ).stdout.split()
    peak, final = int(out[0]), int(out[1])
    assert peak <= 1.25 * size + 16 * 2**20, (peak, size)
    assert final <= 1.1 * size + 16 * 2**20, (final, size)
