"""Q4_0 / Q8_0 tensors of a GGUF file reach the kernels as the file's own bytes (no
requantization), with llama.cpp's q/k row permutation undone block row by block row."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from syshax.shared.sampling import SamplingParams
from syshax.workers.cpu import lib
from syshax.workers.cpu.quantized import QuantLinear, quantize_model
from syshax.workers.engine.engine import Engine
from syshax.workers.engine.gguf_rope import permute_qk, unpermute_qk
from syshax.workers.engine.loader import load_model

from ..engine.test_gguf_weights import META, N_HEAD, N_KV, _layer, _write

QUANTIZED = [
    "token_embd.weight",
    "blk.0.attn_q.weight",
    "blk.0.attn_k.weight",
    "blk.0.attn_v.weight",
    "blk.0.attn_output.weight",
    "blk.0.ffn_gate.weight",
    "blk.0.ffn_up.weight",
    "blk.0.ffn_down.weight",
]


def _llama_file(tmp_path, qtype: T):
    """A one-layer llama GGUF, every matrix in `qtype`, q/k permuted as llama.cpp stores them;
    returns the path and the HF-order float weights."""
    hf = _layer(seed=3)
    stored = dict(hf)
    stored["blk.0.attn_q.weight"] = permute_qk(hf["blk.0.attn_q.weight"], N_HEAD)
    stored["blk.0.attn_k.weight"] = permute_qk(hf["blk.0.attn_k.weight"], N_KV)
    for name in QUANTIZED:
        stored[name] = (qtype, stored[name])
    return _write(tmp_path / f"tiny.{qtype.name}.gguf", "llama", META, stored), hf


def _q(arr: np.ndarray, qtype: T) -> np.ndarray:
    return gguf.quants.quantize(arr, qtype)


@pytest.mark.parametrize(("name", "qtype"), [("q8_0", T.Q8_0), ("q4_0", T.Q4_0)])
def test_file_blocks_are_used_bit_exactly(tmp_path, name, qtype):
    path, hf = _llama_file(tmp_path, qtype)
    loaded = load_model(path, max_model_len=64, progress=False)
    report = quantize_model(loaded.model, name, loaded.raw)
    assert (report.from_file, report.quantized) == (5, 0)  # qkv, o, gate_up, down, lm_head
    layer = loaded.model.layers[0]
    expected = {
        layer.self_attn.qkv_proj: np.concatenate(
            [_q(hf[f"blk.0.attn_{x}.weight"], qtype) for x in "qkv"]
        ),
        layer.self_attn.o_proj: _q(hf["blk.0.attn_output.weight"], qtype),
        layer.mlp.gate_up_proj: np.concatenate(
            [_q(hf["blk.0.ffn_gate.weight"], qtype), _q(hf["blk.0.ffn_up.weight"], qtype)]
        ),
        layer.mlp.down_proj: _q(hf["blk.0.ffn_down.weight"], qtype),
        loaded.model.lm_head: _q(hf["token_embd.weight"], qtype),  # tied: the embedding's
    }
    for module, blocks in expected.items():
        assert isinstance(module, QuantLinear)
        rows, cols = module.out_features, module.in_features
        assert np.array_equal(lib.unpack(module.blocks, module.qtype, rows, cols).numpy(), blocks)
    # ...and those are the bytes in the file, the q rows un-permuted.
    (q_file,) = [t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.attn_q.weight"]
    q_rows = N_HEAD * 8
    qkv = layer.self_attn.qkv_proj
    ours = lib.unpack(qkv.blocks, qkv.qtype, qkv.out_features, qkv.in_features).numpy()
    assert np.array_equal(ours[:q_rows], unpermute_qk(np.asarray(q_file.data), N_HEAD))


def test_other_block_types_are_requantized_from_float(tmp_path):
    path, _ = _llama_file(tmp_path, T.Q8_0)
    loaded = load_model(path, max_model_len=64, progress=False)
    report = quantize_model(loaded.model, "q4_0", loaded.raw)
    assert (report.from_file, report.quantized) == (0, 5)


def greedy_on_both_paths(path, quantize: str, prompt: list[int], n: int, **kw) -> list[list[int]]:
    """Greedy tokens of the PyTorch path and of the fused step, same weights."""
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    outs = []
    for mode in (None, "fused"):
        e = Engine(
            path,
            max_model_len=64,
            max_num_seqs=2,
            load_tokenizer=False,
            progress=False,
            quantize=quantize,
            op_mode=mode,
            **kw,
        )
        outs.append([o.token_id for o in e.generate(prompt, params)])
    return outs


def test_quantized_gguf_engine_generates_with_both_paths(tmp_path):
    path, _ = _llama_file(tmp_path, T.Q4_0)
    outs = greedy_on_both_paths(path, "q4_0", [1, 5, 9, 12], 12)
    assert len(outs[0]) == 12 and all(0 <= t < 40 for t in outs[0])
    # One layer, same blocks: the paths' float rounding differences do not reach the argmax.
    assert outs[0] == outs[1]
