"""Static KV cache: one preallocated tensor for keys and one for values, indexed by slot.

Layout `[layers, slots, kv_heads, max_model_len, head_dim]`. Nothing is allocated per step:
prefill and decode write into it in place. A sequence keeps its slot for its whole life.

The cache is zero-filled on creation: the PyTorch decode reads whole `[slots, :, :L]` rows and
masks the positions a sequence has not written, and a masked position must still hold a
finite number (0 * NaN is NaN).
"""

from __future__ import annotations

import torch

from .config import ModelConfig


class KVCache:
    def __init__(
        self,
        config: ModelConfig,
        num_slots: int,
        max_model_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
        zero: bool = True,
    ):
        """`zero=False` leaves the memory untouched for whoever fills it (the fused CPU step
        zeroes it from the threads that will read it, for NUMA placement)."""
        shape = (
            config.num_layers,
            num_slots,
            config.num_kv_heads,
            max_model_len,
            config.head_dim,
        )
        alloc = torch.zeros if zero else torch.empty
        self.k = alloc(shape, dtype=dtype, device=device)
        self.v = alloc(shape, dtype=dtype, device=device)
        self.num_slots = num_slots
        self.max_model_len = max_model_len

    @staticmethod
    def bytes_needed(
        config: ModelConfig, num_slots: int, max_model_len: int, dtype: torch.dtype
    ) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        per_slot = config.num_layers * config.num_kv_heads * max_model_len * config.head_dim
        return 2 * num_slots * per_slot * elem

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def read(self, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of one sequence's keys and values: `[layers, kv_heads, length, head_dim]`."""
        return self.k[:, slot, :, :length], self.v[:, slot, :, :length]

    def write(self, slot: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Fill positions `[0, T)` of `slot` from `[layers, kv_heads, T, head_dim]` tensors."""
        length = keys.shape[2]
        self.k[:, slot, :, :length] = keys.to(self.k.dtype)
        self.v[:, slot, :, :length] = values.to(self.v.dtype)
