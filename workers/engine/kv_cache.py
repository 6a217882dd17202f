"""Paged KV cache: one preallocated tensor for keys and one for values, in blocks.

Layout `[layers, num_blocks, kv_heads, block_size, head_dim]`: position t of a sequence is row
t % block_size of block block_table[t // block_size] (the block manager hands blocks out;
see block_manager.py). Nothing is allocated per step: prefill and decode write in place, and
a sequence's keys of one KV head are contiguous within a block.

The cache is zero-filled on creation: the PyTorch decode reads whole blocks and masks the
positions a sequence has not written, and a masked position must still hold a finite number
(0 * NaN is NaN).
"""

from __future__ import annotations

import torch

from .config import ModelConfig


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
        shape = (config.num_layers, num_blocks, config.num_kv_heads, block_size, config.head_dim)
        alloc = torch.zeros if zero else torch.empty
        self.k = alloc(shape, dtype=dtype, device=device)
        self.v = alloc(shape, dtype=dtype, device=device)
        self.num_blocks, self.block_size = num_blocks, block_size

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_layers * config.num_kv_heads * block_size * config.head_dim * elem

    @staticmethod
    def bytes_needed(
        config: ModelConfig, num_seqs: int, max_model_len: int, dtype: torch.dtype
    ) -> int:
        """Bytes for `num_seqs` sequences of `max_model_len` positions each."""
        return num_seqs * KVCache.bytes_per_block(config, max_model_len, dtype)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def _index(self, block_table: list[int], length: int) -> torch.Tensor:
        blocks = -(-length // self.block_size)
        return torch.tensor(block_table[:blocks], dtype=torch.long, device=self.k.device)

    def read(self, block_table: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of one sequence's keys and values: `[layers, kv_heads, length, head_dim]`."""
        idx = self._index(block_table, length)

        def gather(cache: torch.Tensor) -> torch.Tensor:
            x = cache[:, idx]  # [layers, blocks, kv_heads, block_size, head_dim]
            layers, blocks, heads, size, dim = x.shape
            x = x.permute(0, 2, 1, 3, 4).reshape(layers, heads, blocks * size, dim)
            return x[:, :, :length]

        return gather(self.k), gather(self.v)

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
            x = x.to(cache.dtype)  # no copy when the dtypes match
            layers, heads, _, dim = x.shape
            if full:
                blocks = x[:, :, : full * size].reshape(layers, heads, full, size, dim)
                cache[:, idx[:full]] = blocks.permute(0, 2, 1, 3, 4)
            if length > full * size:
                cache[:, idx[full], :, : length - full * size] = x[:, :, full * size :]

        scatter(self.k, keys)
        scatter(self.v, values)
