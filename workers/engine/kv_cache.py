"""Paged KV cache: one preallocated tensor for keys and one for values, in blocks.

Layout `[layers, num_blocks, kv_heads, block_size, head_dim]`: position t of a sequence is row
t % block_size of block block_table[t // block_size] (the block manager hands blocks out;
see block_manager.py). Nothing is allocated per step: prefill and decode write in place, and
a sequence's keys of one KV head are contiguous within a block.

The cache is zero-filled on creation: the PyTorch decode reads whole blocks and masks the
positions a sequence has not written, and a masked position must still hold a finite number
(0 * NaN is NaN).

`Q8_0`: the fused CPU step's 8-bit cache (llama.cpp's `--cache-type-k/v q8_0`). Each key or
value row is head_dim / 32 GGML Q8_0 blocks (an fp16 scale and 32 int8s, ggml's reference
rounding), so the tensors are uint8 `[..., block_size, head_dim / 32 * 34]`: 53% of fp16's
bytes, which is what attention at long contexts streams and what bounds how many positions
fit. Only the native kernels read it (workers/cpu/native/attention.c); rows come in and go
out of it (a KV handoff's import and export) through their quantizer, as float32 on the way
out.
"""

from __future__ import annotations

import torch

from .config import ModelConfig

Q8_0 = "q8_0"  # a KV dtype beside the torch ones: rows of Q8_0 blocks
Q8_0_BLOCK, Q8_0_BYTES = 32, 34  # elements and bytes of one block
KVDType = torch.dtype | str


def row_bytes(head_dim: int, dtype: KVDType) -> int:
    """Bytes of one position's key (or value) of one KV head."""
    if dtype == Q8_0:
        return head_dim // Q8_0_BLOCK * Q8_0_BYTES
    return head_dim * torch.empty((), dtype=dtype).element_size()


def check_fits(config: ModelConfig, dtype: KVDType, device: torch.device | str = "cpu") -> None:
    """ValueError when a cache of `dtype` cannot hold this model's KV on `device`."""
    if dtype == Q8_0 and (config.head_dim % Q8_0_BLOCK or torch.device(device).type != "cpu"):
        raise ValueError(
            f"a q8_0 KV cache needs the CPU and head_dim a multiple of {Q8_0_BLOCK} "
            f"(this model's is {config.head_dim})"
        )


def fitting(config: ModelConfig, dtype: KVDType) -> KVDType:
    """`dtype`, or float16 where a Q8_0 cache cannot hold this model's rows: a draft model
    beside a target with a Q8_0 cache keeps a cache it can run."""
    if dtype == Q8_0 and config.head_dim % Q8_0_BLOCK:
        return torch.float16
    return dtype


def dtype_name(dtype: KVDType) -> str:
    """ "float16", "q8_0", ...: as options and logs name it."""
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


class KVCache:
    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        zero: bool = True,
    ):
        """`zero=False` leaves the memory untouched for whoever fills it: the fused CPU step,
        which zeroes it from its own threads on a NUMA host (placement) and elsewhere lets
        each block be faulted in when a sequence first writes it (it never reads a position
        it has not written)."""
        check_fits(config, dtype, device)
        quantized = dtype == Q8_0
        row = row_bytes(config.head_dim, dtype) if quantized else config.head_dim
        shape = (config.num_layers, num_blocks, config.num_kv_heads, block_size, row)
        alloc = torch.zeros if zero else torch.empty
        storage = torch.uint8 if quantized else dtype
        self.k = alloc(shape, dtype=storage, device=device)
        self.v = alloc(shape, dtype=storage, device=device)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.dtype, self.head_dim = dtype, config.head_dim

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: KVDType) -> int:
        row = row_bytes(config.head_dim, dtype)
        return 2 * config.num_layers * config.num_kv_heads * block_size * row

    @staticmethod
    def bytes_needed(config: ModelConfig, num_seqs: int, max_model_len: int, dtype: KVDType) -> int:
        """Bytes for `num_seqs` sequences of `max_model_len` positions each."""
        return num_seqs * KVCache.bytes_per_block(config, max_model_len, dtype)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def _index(self, block_table: list[int], length: int) -> torch.Tensor:
        blocks = -(-length // self.block_size)
        return torch.tensor(block_table[:blocks], dtype=torch.long, device=self.k.device)

    def read(self, block_table: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of one sequence's keys and values: `[layers, kv_heads, length, head_dim]`
        (float32 from a Q8_0 cache: an int8 times an fp16 scale needs up to 18 significant
        bits, more than fp16 holds, and a KV blob must give back the cache's values exactly:
        quantized again on import, they are the same blocks)."""
        idx = self._index(block_table, length)

        def gather(cache: torch.Tensor) -> torch.Tensor:
            x = cache[:, idx]  # [layers, blocks, kv_heads, block_size, head_dim]
            layers, blocks, heads, size, dim = x.shape
            x = x.permute(0, 2, 1, 3, 4).reshape(layers, heads, blocks * size, dim)
            return self._decode(x[:, :, :length])

        return gather(self.k), gather(self.v)

    def _encode(self, x: torch.Tensor) -> torch.Tensor:
        """Rows `[..., head_dim]` as the cache holds them."""
        if self.dtype != Q8_0:
            return x.to(self.dtype)  # no copy when the dtypes match
        from syshax.workers.cpu import lib

        flat = lib.quantize(x.reshape(-1, self.head_dim), lib.Q8_0)
        return flat.reshape(*x.shape[:-1], flat.shape[-1])

    def _decode(self, rows: torch.Tensor) -> torch.Tensor:
        if self.dtype != Q8_0:
            return rows
        from syshax.workers.cpu import lib

        flat = lib.dequantize(rows.reshape(-1, rows.shape[-1]), lib.Q8_0, self.head_dim)
        return flat.reshape(*rows.shape[:-1], self.head_dim)

    def write(self, block_table: list[int], keys: torch.Tensor, values: torch.Tensor) -> None:
        """Fill positions `[0, T)` of a sequence from `[layers, kv_heads, T, head_dim]` tensors."""
        length = keys.shape[2]
        idx = self._index(block_table, length)
        size = self.block_size
        full = length // size

        # One copy per position, straight from `keys`/`values` (which may be views of a KV
        # lease's shared memory): whole blocks as a view, then the last block's rows. The
        # last block's other rows may belong to nobody yet: they keep what they hold.
        def scatter(cache: torch.Tensor, x: torch.Tensor) -> None:
            x = self._encode(x)
            layers, heads, _, dim = x.shape
            if full:
                blocks = x[:, :, : full * size].reshape(layers, heads, full, size, dim)
                cache[:, idx[:full]] = blocks.permute(0, 2, 1, 3, 4)
            if length > full * size:
                cache[:, idx[full], :, : length - full * size] = x[:, :, full * size :]

        scatter(self.k, keys)
        scatter(self.v, values)
