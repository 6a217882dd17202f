"""Tiny random-weight models of each supported architecture, saved as HF folders (shared by
the engine tests and the CPU-kernel tests)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

ARCHS = ["llama", "llama3_scaled", "mistral", "qwen2", "qwen3", "smollm_tied"]


def make_hf_model(arch: str, folder: Path):
    """Build a tiny `transformers` model of `arch`, save it to `folder`, return it (eval mode)."""
    import transformers as tf

    common = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA everywhere: the common case for modern models
        max_position_embeddings=256,
        tie_word_embeddings=False,
        # Larger than the default 0.02 so random logits are not flat (no near-ties in argmax).
        initializer_range=0.3,
    )
    if arch == "llama":
        cfg, cls = tf.LlamaConfig(**common), tf.LlamaForCausalLM
    elif arch == "llama3_scaled":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        cfg, cls = tf.LlamaConfig(**common, rope_parameters=rope), tf.LlamaForCausalLM
    elif arch == "mistral":
        cfg, cls = tf.MistralConfig(**common, sliding_window=None), tf.MistralForCausalLM
    elif arch == "qwen2":
        cfg, cls = tf.Qwen2Config(**common), tf.Qwen2ForCausalLM
    elif arch == "qwen3":
        cfg, cls = tf.Qwen3Config(**common, head_dim=32), tf.Qwen3ForCausalLM
    elif arch == "smollm_tied":
        common.update(tie_word_embeddings=True, num_key_value_heads=1)
        cfg, cls = tf.LlamaConfig(**common), tf.LlamaForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(1234)
    model = cls(cfg).eval()
    if arch == "qwen2":
        # transformers zero-initialises biases; random ones make the bias path matter.
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                ):
                    proj.bias.normal_(0, 0.3)
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, tuple[Path, object]]:
    out = {}
    for arch in ARCHS:
        folder = tmp_path_factory.mktemp(arch)
        out[arch] = (folder, make_hf_model(arch, folder))
    return out
