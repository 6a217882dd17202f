"""KV cache blocks: who holds which, and automatic prefix caching. Torch-free (nano-vllm's
shape): the engine's cache tensor is `[layers, num_blocks, kv_heads, block_size, head_dim]`
and a sequence's `block_table` lists its blocks in position order (position t is row
t % block_size of block block_table[t // block_size]).

Prefix caching (vLLM's APC): a block whose positions are all computed is keyed by its tokens
and the key of the block before it, so a key names a whole prefix. A new sequence whose
prompt starts with cached blocks takes them (reference counted) instead of computing them
again: a shared system prompt is prefilled once per worker. Blocks nobody holds stay cached
until their memory is needed, then the least recently freed goes first (LRU). A shared block
is never written: it is full, and a sequence only writes positions from its `num_cached` on.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from .sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need blocks: {num_blocks} blocks of {block_size} positions")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.prefix_caching = prefix_caching
        self.refs = [0] * num_blocks
        self.key_of: list[tuple | None] = [None] * num_blocks
        self.cached: dict[tuple, int] = {}  # prefix key -> block holding it
        self.free: deque[int] = deque(range(num_blocks))  # held by nobody, cache nothing
        self.evictable: OrderedDict[int, None] = OrderedDict()  # held by nobody, cached: LRU
        self.hits = self.queries = 0  # prefix-cache blocks found / looked up

    # ---- counts -------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks a sequence can take now (evicting cached ones if needed)."""
        return len(self.free) + len(self.evictable)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- holding blocks -----------------------------------------------------------------

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) - len(seq.block_table) <= self.num_free

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Give `seq` blocks for its first `num_tokens` positions; False (and nothing taken)
        when there are not enough."""
        if not self.can_grow(seq, num_tokens):
            return False
        while len(seq.block_table) < self.blocks_for(num_tokens):
            seq.block_table.append(self._take())
        return True

    def shrink(self, seq: Sequence, num_tokens: int) -> None:
        """Free `seq`'s blocks beyond its first `num_tokens` positions (the rows a speculative
        step wrote for tokens the target rejected). They are never shared nor cached: only
        blocks whose positions are all computed and accepted are keyed."""
        while len(seq.block_table) > self.blocks_for(num_tokens):
            block = seq.block_table.pop()
            self.refs[block] -= 1
            if self.refs[block] == 0:
                assert self.key_of[block] is None, "a cached block past the sequence's end"
                self.free.append(block)

    def release(self, seq: Sequence) -> None:
        """Drop `seq`'s blocks; cached ones stay findable until evicted (last block first, so
        a prefix's tail is evicted before its head)."""
        for block in reversed(seq.block_table):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if self.key_of[block] is not None:
                    self.evictable[block] = None
                else:
                    self.free.append(block)
        seq.block_table = []
        seq.block_keys = []

    def _take(self) -> int:
        if self.free:
            block = self.free.popleft()
        else:
            block, _ = self.evictable.popitem(last=False)
            del self.cached[self.key_of[block]]
            self.key_of[block] = None
        self.refs[block] = 1
        return block

    # ---- prefix caching -----------------------------------------------------------------

    def _key(self, seq: Sequence, index: int) -> tuple:
        parent = seq.block_keys[index - 1] if index else None
        start = index * self.block_size
        # hash() of the parent key keeps keys small; the tokens themselves are compared
        return (hash(parent), tuple(seq.all_ids[start : start + self.block_size]))

    def match_prefix(self, seq: Sequence) -> int:
        """Give a sequence with no blocks yet the cached blocks its tokens start with; returns
        the positions they cover. At least one position is left to compute (its logits give
        the next token)."""
        if not self.prefix_caching or seq.block_table:
            return 0
        full = (seq.length - 1) // self.block_size
        for index in range(full):
            key = self._key(seq, index)
            self.queries += 1
            block = self.cached.get(key)
            if block is None:
                break
            self.hits += 1
            if self.refs[block] == 0:
                del self.evictable[block]
            self.refs[block] += 1
            seq.block_table.append(block)
            seq.block_keys.append(key)
        return len(seq.block_table) * self.block_size

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix nobody holds (vLLM's reset_prefix_cache): their blocks
        become plain free blocks, so the next prompts compute from scratch, as a cold worker
        would (a benchmark's rounds, a fresh start without a reload). Blocks that running
        sequences hold keep their keys (others may still share them). Returns the blocks
        forgotten."""
        forgotten = list(self.evictable)
        for block in forgotten:
            del self.cached[self.key_of[block]]
            self.key_of[block] = None
            self.free.append(block)
        self.evictable.clear()
        return len(forgotten)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Make `seq`'s blocks whose positions are all computed findable by later prompts."""
        if not self.prefix_caching:
            return
        full = min(seq.num_cached // self.block_size, len(seq.block_table))
        for index in range(len(seq.block_keys), full):
            key = self._key(seq, index)
            seq.block_keys.append(key)
            block = seq.block_table[index]
            if key not in self.cached and self.key_of[block] is None:
                self.cached[key] = block
                self.key_of[block] = key
