"""INFERENCE_OP_MODE=fused: a whole engine step (decodes and prompt chunks) in one native call
(sx_step), reading the paged KV cache through block tables.

`FusedDecoder` describes the loaded `Transformer` to the kernels once (pointers to its
weights, norms, rope tables and the engine's KV cache, no copies) and then runs steps. It
reads the same weights as the PyTorch path: QuantLinear blocks (stacked parts too) when the
model is quantized, the float Linear weights otherwise, and the embedding table in its stored
blocks when it is a QuantEmbedding, so both paths produce the same tokens within float
rounding of the non-GEMM ops (the GEMM and row-dequantization code is shared).
"""

from __future__ import annotations

import ctypes

import torch
from syshax.workers.engine.runner import block_tables
from torch import nn

from . import lib
from .affinity import numa_nodes
from .quantized import QuantEmbedding, QuantLinear

_ERRORS = {
    -1: "batch size out of range",
    -2: "a position is outside the KV cache",
    -3: "a token id is outside the vocabulary",
    -4: "a sequence or KV block is out of range",
    -5: "rows of one sequence are not adjacent at consecutive positions",
    -6: "an output row is out of range",
}


class FusedError(RuntimeError):
    """The fused step cannot run this model or batch; the message says why."""


class _Kept:
    """What the kernels read through raw pointers (float copies of norms and rope tables,
    contiguous weights, the layer array): it lives as long as the decoder."""

    def __init__(self) -> None:
        self.tensors: list = []

    def keep(self, obj):
        self.tensors.append(obj)
        return obj

    def f32(self, t: torch.Tensor | None) -> int | None:
        if t is None:
            return None
        t = t.detach().float().contiguous()
        self.tensors.append(t)
        return t.data_ptr()

    def mat(self, module: nn.Module) -> lib.SxMat:
        if isinstance(module, QuantLinear):
            return module.mat
        if isinstance(module, nn.Linear):
            w = module.weight.detach()
            if w.dtype != torch.float32:
                raise FusedError("fused mode needs float32 weights or SYSHAX_QUANTIZE=q8_0|q4_0")
            w = w.contiguous()
            b = None if module.bias is None else module.bias.detach().float().contiguous()
            self.tensors += [w, b]
            return lib.make_mat(lib.F32, w, module.out_features, module.in_features, b)
        raise FusedError(f"cannot run a {type(module).__name__} in the fused step")


def _check(c, cache) -> None:
    """Refuse what the kernels cannot run, before anything is built."""
    if (
        cache.k.dtype not in (torch.float32, torch.float16, torch.uint8)
        or cache.k.device.type != "cpu"
    ):
        raise FusedError("fused mode runs on the CPU with a float32, float16 or q8_0 KV cache")
    if c.head_dim % 8 or c.head_dim > 512:
        raise FusedError(f"fused mode needs head_dim a multiple of 8 up to 512, got {c.head_dim}")
    for name, size in (
        ("hidden_size", c.hidden_size),
        ("intermediate_size", c.intermediate_size),
        ("heads x head_dim", c.num_heads * c.head_dim),
    ):
        if size % lib.BLOCK:
            raise FusedError(f"fused mode needs {name} to be a multiple of {lib.BLOCK}, got {size}")
    if cache.block_size % 8:
        raise FusedError("fused mode needs a KV block size that is a multiple of 8")


def _embedding(model: nn.Module, kept: _Kept) -> dict:
    embed = model.embed_tokens
    if isinstance(embed, QuantEmbedding):  # rows stay in the file's blocks
        kept.tensors.append(embed.table)
        return {
            "embed": lib.ptr(embed.table),
            "embed_type": embed.qtype,
            "embed_row_bytes": embed.table.shape[1],
        }
    return {"embed": kept.f32(embed.weight), "embed_type": lib.F32, "embed_row_bytes": 0}


def _layers(model: nn.Module, cache, kept: _Kept):
    layers = (lib.SxLayer * model.config.num_layers)()
    for i, block in enumerate(model.layers):
        attn = block.self_attn
        layers[i] = lib.SxLayer(
            attn_norm=kept.f32(block.input_layernorm.weight),
            ffn_norm=kept.f32(block.post_attention_layernorm.weight),
            q_norm=kept.f32(attn.q_norm.weight) if attn.q_norm is not None else None,
            k_norm=kept.f32(attn.k_norm.weight) if attn.k_norm is not None else None,
            qkv=kept.mat(attn.qkv_proj),
            o=kept.mat(attn.o_proj),
            gate_up=kept.mat(block.mlp.gate_up_proj),
            down=kept.mat(block.mlp.down_proj),
            k_cache=lib.ptr(cache.k[i]),
            v_cache=lib.ptr(cache.v[i]),
        )
    return layers


def _describe(model: nn.Module, cache, kept: _Kept) -> lib.SxModel:
    """The model as the kernels see it: pointers to its weights, norms, rope tables and the
    engine's KV cache, no copies of the weights."""
    c = model.config
    return lib.SxModel(
        n_layers=c.num_layers,
        hidden=c.hidden_size,
        n_heads=c.num_heads,
        n_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        inter=c.intermediate_size,
        vocab=c.vocab_size,
        max_len=model.rope_cos.shape[0],
        n_slots=cache.num_blocks,
        block_size=cache.block_size,
        kv_type=lib.kv_type_of(cache.k.dtype),
        eps=c.rms_norm_eps,
        **_embedding(model, kept),
        final_norm=kept.f32(model.norm.weight),
        lm_head=kept.mat(model.lm_head),
        rope_cos=kept.f32(model.rope_cos),
        rope_sin=kept.f32(model.rope_sin),
        layers=kept.keep(_layers(model, cache, kept)),
    )


class FusedDecoder:
    def __init__(
        self,
        model: nn.Module,
        cache,
        threads: int | None = None,
        nrc: int = 0,
        max_tokens: int = 0,
        variant: str = "native",
    ):
        """`max_tokens`: the most token rows one `step` takes (the scheduler's token budget);
        `variant`: the kernel build (build.py; "profile" adds per-op clocks)."""
        self._ctx = None
        _check(model.config, cache)
        self._lib = lib.load(variant)
        self.simd = self._lib.sx_simd().decode()  # what the kernels run: "...+avx512vnni+amx"
        self.threads = threads or torch.get_num_threads()
        self.vocab = model.config.vocab_size
        if len(numa_nodes()) > 1:
            # Zero the caches from the threads that will use them: each block's first touch
            # puts its pages on the node of the thread that runs its attention. On one node
            # there is nothing to place, and the cache (allocated, not filled) is left to be
            # faulted in block by block as sequences first write it: the kernels never read a
            # position before writing it. That saves the load a pass over the whole cache
            # (1 GiB at 16 x 2048 positions of the 1B shape: ~0.25 s of a 0.9 s load on a VM)
            # and keeps never-used blocks out of the resident set.
            elem = cache.k.element_size()
            shape = cache.k.shape  # [layers, blocks, kv_heads, block_size, row elements]
            self._lib.sx_place_kv(lib.ptr(cache.k), lib.ptr(cache.v), *shape, elem, self.threads)
        kept = _Kept()
        kept.tensors += [cache.k, cache.v]
        self.model_desc = _describe(model, cache, kept)
        self._keep = kept.tensors  # the layer array too: the struct holds only its pointer
        self.max_tokens = max(max_tokens, 1)
        self._ctx = self._lib.sx_ctx_new(
            ctypes.byref(self.model_desc), self.max_tokens, self.threads, nrc
        )
        if not self._ctx:
            raise FusedError("could not allocate the fused step's buffers")

    def step(
        self,
        tokens: list[int],
        positions: list[int],
        seqs: list[int],
        tables: list[list[int]],
        out_rows: list[int],
    ) -> torch.Tensor:
        """One step over token rows of any sequences (decodes and prompt chunks mixed): row i
        is tokens[i] of sequence seqs[i] (block table tables[seqs[i]]) at positions[i]; rows of
        one sequence are adjacent at consecutive positions. Returns logits
        [len(out_rows), vocab] (fp32)."""
        n = len(tokens)
        tok = torch.tensor(tokens, dtype=torch.int64)
        pos = torch.tensor(positions, dtype=torch.int64)
        seq = torch.tensor(seqs, dtype=torch.int64)
        table = block_tables(tables, "cpu", torch.int32)
        out = torch.tensor(out_rows, dtype=torch.int64)
        logits = torch.empty((len(out_rows), self.vocab), dtype=torch.float32)
        rc = self._lib.sx_step(
            self._ctx,
            n,
            tok.data_ptr(),
            pos.data_ptr(),
            seq.data_ptr(),
            table.data_ptr(),
            table.shape[1],
            len(out_rows),
            out.data_ptr(),
            logits.data_ptr(),
        )
        if rc != 0:
            raise FusedError(f"fused step refused the batch: {_ERRORS.get(rc, rc)}")
        return logits

    def close(self) -> None:
        if self._ctx:
            self._lib.sx_ctx_free(self._ctx)
            self._ctx = None

    def __del__(self) -> None:
        self.close()
