"""A fixed pool of KV block slots with reference counts and a prefix cache.

Every block is in exactly one of three states:

    free      ref 0, holds nothing reusable            → `_free` (a stack)
    cached    ref 0, holds a full block under its key  → `_lru` (oldest first), reusable on a hit
    in use    ref ≥ 1, owned by one or more sequences

free + cached + in-use = total, always (`check_invariants`). Allocation takes free blocks first and
then evicts the least-recently-used cached block. A block whose last owner lets go becomes cached if
it has a key, free otherwise. Owners release a sequence's blocks tail first, so a sequence's last
blocks become the oldest in the LRU and are evicted before its (more shareable) first blocks.

The pool emits `BlockStored` / `BlockEvicted` events, in order, to each event queue a reader added
with `add_event_queue()` (the kvstore's Valkey hints read one, the routing index another); with no
queue, nothing is kept.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from shared.kvcache.block_hash import BlockKey


@dataclass(frozen=True)
class BlockStored:
    key: BlockKey
    block_id: int


@dataclass(frozen=True)
class BlockEvicted:
    key: BlockKey
    block_id: int


class BlockPool:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True,
                 on_grow: Callable[[int], None] | None = None):
        """`on_grow(high_water)` is called when an allocation hands out a block never handed out
        before: blocks [0, high_water) have all been used. (Their memory is first touched in that
        order: `shared.kvcache.pages.WarmAhead` faults it in ahead.)"""
        if num_blocks <= 0:
            raise ValueError(f"block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.high_water = 0
        self._on_grow = on_grow
        self.ref_counts = [0] * num_blocks
        self.block_key: list[BlockKey | None] = [None] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, … first
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced: oldest first
        self._by_key: dict[BlockKey, int] = {}
        self._queues: list[list[BlockStored | BlockEvicted]] = []

    # ------------------------------------------------------------------------------------ queries

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take right now (free + evictable cached)."""
        return len(self._free) + len(self._lru)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._lru)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free_blocks

    def match_prefix(self, keys: list[BlockKey]) -> list[int]:
        """Blocks holding the longest cached prefix of `keys` (no references taken)."""
        if not self.enable_prefix_caching:
            return []
        hits = []
        for key in keys:
            block = self._by_key.get(key)
            if block is None:
                break
            hits.append(block)
        return hits

    # ---------------------------------------------------------------------------------- mutations

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free_blocks:
            raise MemoryError(f"asked for {n} KV blocks, only {self.num_free_blocks} free")
        blocks = []
        for _ in range(n):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._lru.popitem(last=False)
                self._evict(block)
            self.ref_counts[block] = 1
            blocks.append(block)
        top = max(blocks, default=-1) + 1
        if top > self.high_water:
            self.high_water = top
            if self._on_grow is not None:
                self._on_grow(top)
        return blocks

    def acquire(self, blocks: list[int]) -> None:
        """Take a reference on blocks found by `match_prefix` (cached ones leave the LRU)."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                if self.block_key[block] is None:
                    raise ValueError(f"block {block} is free and holds nothing to share")
                del self._lru[block]
            self.ref_counts[block] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one reference from each block, in the order given (callers pass tail first)."""
        for block in blocks:
            if self.ref_counts[block] <= 0:
                raise ValueError(f"block {block} released more often than acquired")
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if self.block_key[block] is not None:
                    self._lru[block] = None  # most recently used end
                else:
                    self._free.append(block)

    def cache_block(self, block: int, key: BlockKey) -> None:
        """Publish a full, computed, in-use block under its key. A key already cached elsewhere
        (two sequences computed the same prefix at once) keeps its first block; this one stays
        private and returns to the free list when released."""
        if not self.enable_prefix_caching or self.block_key[block] is not None or key in self._by_key:
            return
        if self.ref_counts[block] <= 0:
            raise ValueError(f"block {block} must be in use to be cached")
        self.block_key[block] = key
        self._by_key[key] = block
        self._emit(BlockStored(key, block))

    def reset_prefix_cache(self) -> int:
        """Forget every cached block: unreferenced ones are freed, those in use become private (they
        are freed when released). Returns how many blocks were forgotten."""
        n = len(self._by_key)
        while self._lru:
            block, _ = self._lru.popitem(last=False)
            self._evict(block)
            self._free.append(block)
        for block in list(self._by_key.values()):
            self._evict(block)
        return n

    def add_event_queue(self) -> int:
        """A new queue that sees every event from now on; returns its number for `take_events`."""
        self._queues.append([])
        return len(self._queues) - 1

    def take_events(self, queue: int) -> list[BlockStored | BlockEvicted]:
        events, self._queues[queue] = self._queues[queue], []
        return events

    def cached_keys(self) -> list[BlockKey]:
        """Every key a prefix lookup can hit now (cached and in-use blocks alike)."""
        return list(self._by_key)

    def _emit(self, event: BlockStored | BlockEvicted) -> None:
        for queue in self._queues:
            queue.append(event)

    def _evict(self, block: int) -> None:
        key = self.block_key[block]
        if key is not None:
            del self._by_key[key]
            self.block_key[block] = None
            self._emit(BlockEvicted(key, block))

    def check_invariants(self) -> None:
        """free + cached + in-use = total, and the three sets are disjoint and consistent."""
        in_use = sum(1 for r in self.ref_counts if r > 0)
        free, cached = set(self._free), set(self._lru)
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert not free & cached, "a block is both free and cached"
        assert len(free) + len(cached) + in_use == self.num_blocks, (
            f"block leak: free {len(free)} + cached {len(cached)} + in use {in_use} != {self.num_blocks}"
        )
        assert all(self.ref_counts[b] == 0 and self.block_key[b] is None for b in free)
        assert all(self.ref_counts[b] == 0 and self.block_key[b] is not None for b in cached)
        assert all(self._by_key[self.block_key[b]] == b for b in range(self.num_blocks) if self.block_key[b] is not None)
