"""Model runners: turn a `ScheduledStep` (token rows of many sequences) into the logits of its
sampling rows. The engine owns one; the scheduler never sees torch.

* `FusedRunner` (the CPU default): every row of the step, decodes and prompt chunks mixed,
  in one native call (sx_step): one pass over the weights for the whole step.
* `TorchRunner` (GPU, float CPU): the decode rows as one batch, then each prompt chunk (and
  each decode with a speculative draft, as a chunk of its k+1 rows).

A chunk with a draft gives the logits of all its rows (the verifier reads each); any other
sampling chunk gives its last row's.
"""

from __future__ import annotations

import torch

from .kv_cache import KVCache
from .scheduled_step import Chunk, ScheduledStep


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
            if c.samples:  # a draft's chunk: every row (the last token's and each draft's)
                out_rows += range(len(tokens) - 1 - len(c.draft), len(tokens))
        tables = [c.seq.block_table for c in step.chunks]
        return self.fused.step(tokens, positions, seqs, tables, out_rows)

    def prompt_logits(self, token_ids: list[int], table: list[int], first: int) -> torch.Tensor:
        """Logits [len(token_ids) - first, vocab] of positions first.. of one sequence computed
        from position 0 (block table `table`), in steps of at most the step's row budget."""
        parts = []
        width = self.fused.max_tokens
        for start in range(0, len(token_ids), width):
            rows = token_ids[start : start + width]
            out = [i for i in range(len(rows)) if start + i >= first]
            positions = list(range(start, start + len(rows)))
            parts.append(self.fused.step(rows, positions, [0] * len(rows), [table], out))
        return torch.cat(parts)


class TorchRunner:
    def __init__(self, model, cache: KVCache, device: torch.device):
        self.model, self.cache, self.device = model, cache, device

    def execute(self, step: ScheduledStep) -> torch.Tensor:
        logits: dict[int, torch.Tensor] = {}
        singles = [c for c in step.chunks if c.length == 1]
        if singles:
            for c, row in zip(singles, self._decode(singles), strict=True):
                logits[id(c)] = row[None]
        for c in step.chunks:
            if c.length > 1:
                ids = torch.tensor(c.token_ids, dtype=torch.long, device=self.device)
                table = torch.tensor(c.seq.block_table, dtype=torch.long, device=self.device)
                if c.draft:  # every row: the last token's and each draft's
                    first = c.length - 1 - len(c.draft)
                    logits[id(c)] = self.model.prefill(ids, self.cache, table, c.start, first)
                else:
                    logits[id(c)] = self.model.prefill(ids, self.cache, table, c.start)[None]
        rows = [logits[id(c)] for c in step.sampling]
        if not rows:
            return torch.empty((0, self.model.config.vocab_size))
        return torch.cat(rows)

    def prompt_logits(self, token_ids: list[int], table: list[int], first: int) -> torch.Tensor:
        """Logits [len(token_ids) - first, vocab] of positions first.. of one sequence computed
        from position 0 (block table `table`), in one prefill."""
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        blocks = torch.tensor(table, dtype=torch.long, device=self.device)
        return self.model.prefill(ids, self.cache, blocks, 0, logits_from=first).cpu()

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
