"""Block mechanics for sequences: prefix matching, slot allocation, caching and freeing.

The scheduler decides *who* runs; this decides nothing and only answers *can this sequence get the
blocks it needs* and does the bookkeeping. A sequence's `block_table` covers its computed tokens
plus the ones scheduled this step:

    block_size 4, 10 tokens computed, 3 scheduled     → needs ceil(13 / 4) = 4 blocks
    | 0 1 2 3 | 4 5 6 7 | 8 9 a b | c . . . |          keys for the 2 full computed blocks
"""

from __future__ import annotations

from typing import Protocol

from shared.kvcache.block_hash import ROOT_KEY, BlockKey, block_keys
from shared.kvcache.block_pool import BlockPool


class HasBlocks(Protocol):
    block_table: list[int]
    block_keys: list[BlockKey]
    num_computed_tokens: int

    @property
    def all_token_ids(self) -> list[int]: ...


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, model_id: str):
        self.pool, self.block_size, self.model_id = pool, block_size, model_id

    def blocks_needed(self, seq: HasBlocks, num_new_tokens: int) -> int:
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(0, total - len(seq.block_table))

    def cached_tokens(self, tokens: list[int]) -> int:
        """How many leading tokens of a prompt the prefix cache holds now, touching nothing: what
        `match_prefix` would find if the sequence were admitted at once."""
        max_blocks = (len(tokens) - 1) // self.block_size
        if not self.pool.enable_prefix_caching or max_blocks <= 0:
            return 0
        return len(self.pool.match_prefix(self._keys(tokens, 0, max_blocks, ROOT_KEY))) * self.block_size

    def match_prefix(self, seq: HasBlocks) -> int:
        """Attach the longest cached prefix to a sequence holding no blocks; returns cached tokens.

        At least one token is always left to compute: the model must run to produce logits."""
        assert not seq.block_table, "prefix matching is for sequences that hold no blocks"
        tokens = seq.all_token_ids
        max_blocks = (len(tokens) - 1) // self.block_size
        keys = self._keys(tokens, 0, max_blocks, ROOT_KEY)
        hits = self.pool.match_prefix(keys)
        self.pool.acquire(hits)
        seq.block_table = list(hits)
        seq.block_keys = keys[: len(hits)]
        seq.num_computed_tokens = len(hits) * self.block_size
        return seq.num_computed_tokens

    def allocate_slots(self, seq: HasBlocks, num_new_tokens: int) -> bool:
        n = self.blocks_needed(seq, num_new_tokens)
        if not self.pool.can_allocate(n):
            return False
        seq.block_table.extend(self.pool.allocate(n))
        return True

    def cache_full_blocks(self, seq: HasBlocks) -> None:
        """Key and publish every block that the computed tokens have filled since last time."""
        full = seq.num_computed_tokens // self.block_size
        start = len(seq.block_keys)
        if full <= start:
            return
        parent = seq.block_keys[-1] if seq.block_keys else ROOT_KEY
        new_keys = self._keys(seq.all_token_ids, start, full, parent)
        for i, key in enumerate(new_keys, start):
            self.pool.cache_block(seq.block_table[i], key)
        seq.block_keys.extend(new_keys)

    def trim(self, seq: HasBlocks) -> None:
        """Give back the blocks past the computed tokens (speculative rows that were rejected).
        They hold no computed token, so none of them was ever keyed."""
        keep = -(-seq.num_computed_tokens // self.block_size)
        if len(seq.block_table) > keep:
            self.pool.release(list(reversed(seq.block_table[keep:])))
            del seq.block_table[keep:]

    def free(self, seq: HasBlocks) -> None:
        """Give back every block, tail first (so the tail is evicted before the shared head)."""
        self.pool.release(list(reversed(seq.block_table)))
        seq.block_table = []
        seq.block_keys = []

    def _keys(self, tokens: list[int], start: int, end: int, parent: BlockKey) -> list[BlockKey]:
        """Keys of full blocks start..end-1, chained from `parent` (the key of block start-1)."""
        return block_keys(tokens[: end * self.block_size], self.block_size, self.model_id, start, parent)
