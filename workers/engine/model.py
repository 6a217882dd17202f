"""The Llama-family transformer, one parameterised file (in the spirit of gpt-fast's model.py).

Two entry points, both writing into the paged KV cache owned by `KVCache` (position t of a
sequence is row t % block_size of block table[t // block_size]):

* `prefill(tokens, cache, table, start)`: one sequence, many tokens, causal attention.
* `decode(tokens, positions, tables, lengths_mask, cache)`: one token for each of `n`
  sequences (attention gathers their blocks' keys and values).

Numerics follow transformers (RMSNorm in fp32, rope tables computed in fp32 then cast), which
is what lets greedy fp32 output be token-identical to it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .kv_cache import KVCache


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse rotary frequencies (fp32), with llama3 scaling applied when configured."""
    dim = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = config.rope_scaling
    if not s:
        return inv
    factor = float(s["factor"])
    low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    old_len = float(s.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.c = c
        q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        # q, k and v share one GEMM: one op instead of three per layer and step.
        self.qkv_proj = nn.Linear(c.hidden_size, q_out + 2 * kv_out, bias=c.qkv_bias)
        self.o_proj = nn.Linear(q_out, c.hidden_size, bias=c.attention_out_bias)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.split = (q_out, kv_out, kv_out)
        self.scale = c.head_dim**-0.5

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Project, normalise and rotate. x: [B, T, hidden] -> q [B,H,T,D], k/v [B,KVH,T,D]."""
        b, t, _ = x.shape
        c = self.c
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = q.view(b, t, c.num_heads, c.head_dim)
        k = k.view(b, t, c.num_kv_heads, c.head_dim)
        v = v.view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, T, D]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        return q, k, v

    def prefill(
        self, x, cos, sin, k_cache, v_cache, table: torch.Tensor, start: int
    ) -> torch.Tensor:
        t = x.shape[1]
        q, k, v = self._qkv(x, cos, sin)
        end = start + t
        size = k_cache.shape[2]
        pos = torch.arange(start, end, device=x.device)
        blocks, rows = table[pos // size], pos % size
        k_cache[blocks, :, rows] = k[0].transpose(0, 1).to(k_cache.dtype)
        v_cache[blocks, :, rows] = v[0].transpose(0, 1).to(v_cache.dtype)
        if start == 0:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            # Continuing a cached prefix: query i sees every cached position <= start + i.
            keys = _gather(k_cache, table[None], end).to(q.dtype)  # the cache may be narrower
            vals = _gather(v_cache, table[None], end).to(q.dtype)
            mask = torch.arange(end, device=x.device)[None, :] <= pos[:, None]
            out = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(1, t, -1))

    def decode(self, x, cos, sin, k_cache, v_cache, tables, positions, mask) -> torch.Tensor:
        """x: [n, 1, hidden]; tables: [n, blocks] block tables; mask: additive [n, 1, 1, L]
        over each sequence's positions [0, L)."""
        n = x.shape[0]
        c = self.c
        q, k, v = self._qkv(x, cos, sin)
        size = k_cache.shape[2]
        blocks = tables[torch.arange(n, device=x.device), positions // size]
        k_cache[blocks, :, positions % size] = k[:, :, 0].to(k_cache.dtype)
        v_cache[blocks, :, positions % size] = v[:, :, 0].to(v_cache.dtype)
        length = mask.shape[-1]
        # A float16 cache under float32 compute: read back what was stored (rounded).
        keys = _gather(k_cache, tables, length).to(q.dtype)
        vals = _gather(v_cache, tables, length).to(q.dtype)
        # Grouped-query attention without repeating K/V: fold the query heads of one KV head
        # into the "query length" axis. [n, KVH, G, D] @ [n, KVH, D, L] -> [n, KVH, G, L].
        group = c.num_heads // c.num_kv_heads
        qg = q.view(n, c.num_kv_heads, group, c.head_dim)
        scores = torch.matmul(qg, keys.transpose(-1, -2)) * self.scale + mask
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        out = torch.matmul(probs, vals)  # [n, KVH, G, D]
        return self.o_proj(out.reshape(n, 1, c.num_heads * c.head_dim))


def _gather(cache: torch.Tensor, tables: torch.Tensor, length: int) -> torch.Tensor:
    """Positions [0, length) of n sequences from a layer's paged cache: [n, kv_heads, length,
    head_dim] (a copy). tables: [n, blocks]."""
    size = cache.shape[2]
    x = cache[tables[:, : -(-length // size)]]  # [n, blocks, kv_heads, size, head_dim]
    n, blocks, heads, _, dim = x.shape
    return x.permute(0, 2, 1, 3, 4).reshape(n, heads, blocks * size, dim)[:, :, :length]


class MLP(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)


class Transformer(nn.Module):
    def __init__(self, c: ModelConfig, max_model_len: int):
        super().__init__()
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        device = self.embed_tokens.weight.device
        if device.type == "meta":  # a shell the loader fills, then calls init_rope (the math on
            # meta tensors would import torch._dynamo: seconds per process)
            shape = (max_model_len, c.head_dim)
            self.register_buffer("rope_cos", torch.empty(shape, device=device), persistent=False)
            self.register_buffer("rope_sin", torch.empty(shape, device=device), persistent=False)
        else:
            self.init_rope(max_model_len, device)

    def init_rope(self, max_model_len: int, device: torch.device | str) -> None:
        """(Re)build the fp32 cos/sin tables for positions [0, max_model_len) on `device`."""
        freqs = torch.arange(max_model_len).float()[:, None] * rope_inv_freq(self.config)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("rope_cos", emb.cos().to(device), persistent=False)
        self.register_buffer("rope_sin", emb.sin().to(device), persistent=False)

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype):
        return self.rope_cos[positions].to(dtype), self.rope_sin[positions].to(dtype)

    @torch.inference_mode()
    def prefill(
        self,
        tokens: torch.Tensor,
        cache: KVCache,
        table: torch.Tensor,
        start: int = 0,
        logits_from: int | None = None,
    ) -> torch.Tensor:
        """Run `tokens` ([T]) of one sequence (block table `table`, a long tensor) from position
        `start`; return last-position logits [V] (fp32), or with `logits_from` = k the logits of
        rows k..T-1 [T-k, V] (perplexity scores every position)."""
        t = tokens.shape[0]
        x = self.embed_tokens(tokens)[None]
        cos, sin = self._rope(torch.arange(start, start + t, device=tokens.device)[None], x.dtype)
        for i, layer in enumerate(self.layers):
            h = layer.input_layernorm(x)
            x = x + layer.self_attn.prefill(h, cos, sin, cache.k[i], cache.v[i], table, start)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        if logits_from is None:
            return self.lm_head(self.norm(x[:, -1])).float()[0]
        return self.lm_head(self.norm(x[0, logits_from:])).float()

    @torch.inference_mode()
    def decode(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        tables: torch.Tensor,
        mask: torch.Tensor,
        cache: KVCache,
    ) -> torch.Tensor:
        """One step for n sequences: tokens/positions [n], block tables [n, blocks]; returns
        logits [n, V] (fp32)."""
        x = self.embed_tokens(tokens)[:, None]  # [n, 1, hidden]
        cos, sin = self._rope(positions[:, None], x.dtype)
        mask = mask.to(x.dtype)
        for i, layer in enumerate(self.layers):
            h = layer.input_layernorm(x)
            x = x + layer.self_attn.decode(
                h, cos, sin, cache.k[i], cache.v[i], tables, positions, mask
            )
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.lm_head(self.norm(x[:, 0])).float()
