"""Model runners: turn a `ScheduledStep` (token rows of many sequences) into the logits of its
sampling rows. The engine owns one; the scheduler never sees torch.

* `FusedRunner` (the CPU default): every row of the step, decodes and prompt chunks mixed,
  in one native call (sx_step): one pass over the weights for the whole step.
* `TorchRunner` (GPU, float CPU): the decode rows as one batch, then each prompt chunk.
"""

from __future__ import annotations

import torch

from .kv_cache import KVCache
from .scheduler import Chunk, ScheduledStep


class FusedRunner:
    def __init__(self, fused):
        self.fused = fused  # workers.cpu.fused.FusedDecoder

    def execute(self, step: ScheduledStep) -> torch.Tensor:
        tokens: list[int] = []
        positions: list[int] = []
        seqs: list[int] = []
        out_rows: list[int] = []
        for i, c in enumerate(step.chunks):
            tokens += c.token_ids
            positions += range(c.start, c.start + c.length)
            seqs += [i] * c.length
            if c.samples:
                out_rows.append(len(tokens) - 1)
        tables = [c.seq.block_table for c in step.chunks]
        return self.fused.step(tokens, positions, seqs, tables, out_rows)


class TorchRunner:
    def __init__(self, model, cache: KVCache, device: torch.device):
        self.model, self.cache, self.device = model, cache, device

    def execute(self, step: ScheduledStep) -> torch.Tensor:
        logits: dict[int, torch.Tensor] = {}
        singles = [c for c in step.chunks if c.length == 1]
        if singles:
            for c, row in zip(singles, self._decode(singles), strict=True):
                logits[id(c)] = row
        for c in step.chunks:
            if c.length > 1:
                ids = torch.tensor(c.token_ids, dtype=torch.long, device=self.device)
                table = torch.tensor(c.seq.block_table, dtype=torch.long, device=self.device)
                logits[id(c)] = self.model.prefill(ids, self.cache, table, c.start)
        rows = [logits[id(c)] for c in step.sampling]
        if not rows:
            return torch.empty((0, self.model.config.vocab_size))
        return torch.stack(rows)

    def _decode(self, chunks: list[Chunk]) -> torch.Tensor:
        """One batched step for sequences one row each (row at position `start`)."""
        dev = self.device
        tokens = torch.tensor([c.token_ids[0] for c in chunks], dtype=torch.long, device=dev)
        positions = torch.tensor([c.start for c in chunks], dtype=torch.long, device=dev)
        tables = block_tables([c.seq.block_table for c in chunks], dev)
        length = max(c.start for c in chunks) + 1
        visible = torch.arange(length, device=dev)[None, :] <= positions[:, None]
        mask = torch.zeros(visible.shape, dtype=torch.float32, device=dev)
        mask.masked_fill_(~visible, float("-inf"))
        return self.model.decode(tokens, positions, tables, mask[:, None, None, :], self.cache)


def block_tables(tables: list[list[int]], device, dtype=torch.long) -> torch.Tensor:
    """[n, longest] block tables, short ones padded with block 0 (never read: masked in the
    PyTorch path, beyond the position in the native one)."""
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=dtype, device=device)
