"""Block pool and prefix cache: exact block ids and eviction order on tiny pools."""

from __future__ import annotations

import pytest

from shared.kvcache.block_hash import ROOT_KEY, block_key, block_keys
from shared.kvcache.block_pool import BlockEvicted, BlockPool, BlockStored
from shared.kvcache.kv_cache_manager import KVCacheManager


def k(i: int) -> bytes:
    return block_key(ROOT_KEY, [i] * 4, "m")


def test_block_key_is_chained_stable_and_128_bit():
    a = block_key(ROOT_KEY, [1, 2, 3, 4], "m")
    assert len(a) == 16
    assert a == block_key(ROOT_KEY, [1, 2, 3, 4], "m")  # deterministic: same in every process
    assert a != block_key(ROOT_KEY, [1, 2, 3, 5], "m")
    assert a != block_key(ROOT_KEY, [1, 2, 3, 4], "other-model")
    assert block_key(a, [5, 6, 7, 8], "m") != block_key(ROOT_KEY, [5, 6, 7, 8], "m")  # parent matters
    keys = block_keys(list(range(10)), 4, "m")  # 2 full blocks; the partial third gets no key
    assert keys == [block_key(ROOT_KEY, [0, 1, 2, 3], "m"), block_key(keys[0], [4, 5, 6, 7], "m")]


def test_allocate_free_exact_ids():
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(1) == [2]
    pool.release([1])
    assert pool.num_free_blocks == 2
    assert pool.allocate(2) == [1, 3]  # the freed block comes back first (stack)
    pool.check_invariants()
    with pytest.raises(MemoryError):
        pool.allocate(1)
    pool.release([0, 1, 2, 3])
    pool.check_invariants()
    assert pool.num_free_blocks == 4


def test_cached_blocks_reused_then_evicted_lru_first():
    pool = BlockPool(4)
    q = pool.add_event_queue()
    blocks = pool.allocate(3)  # [0, 1, 2]
    for b, i in zip(blocks, range(3)):
        pool.cache_block(b, k(i))
    assert pool.take_events(q) == [BlockStored(k(0), 0), BlockStored(k(1), 1), BlockStored(k(2), 2)]
    pool.release([2, 1, 0])  # tail first: LRU order becomes 2, 1, 0 (2 oldest)
    pool.check_invariants()
    assert (pool.num_cached_blocks, pool.num_free_blocks, pool.num_used_blocks) == (3, 4, 0)
    # a hit takes the cached blocks back without recomputing
    assert pool.match_prefix([k(0), k(1), k(9)]) == [0, 1]
    pool.acquire([0, 1])
    assert pool.num_cached_blocks == 1
    # allocation takes the never-used block 3 first, then evicts the LRU cached block (2)
    assert pool.allocate(1) == [3]
    assert pool.take_events(q) == []
    assert pool.allocate(1) == [2]
    assert pool.take_events(q) == [BlockEvicted(k(2), 2)]
    assert pool.match_prefix([k(2)]) == []
    pool.check_invariants()
    pool.release([2, 3, 1, 0])
    # 2 and 3 hold nothing reusable → free; 1 then 0 → cached, LRU order 1, 0
    assert pool.num_cached_blocks == 2
    assert pool.allocate(3) == [3, 2, 1]
    assert pool.take_events(q) == [BlockEvicted(k(1), 1)]
    pool.check_invariants()


def test_shared_block_refcount_and_double_release():
    pool = BlockPool(2)
    [b] = pool.allocate(1)
    pool.cache_block(b, k(0))
    pool.acquire([b])  # a second sequence shares it
    pool.release([b])
    assert pool.num_used_blocks == 1  # still held by the first
    pool.release([b])
    assert pool.num_cached_blocks == 1
    with pytest.raises(ValueError):
        pool.release([b])
    pool.check_invariants()


def test_duplicate_key_keeps_first_block():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.cache_block(a, k(0))
    pool.cache_block(b, k(0))  # computed concurrently: stays private
    pool.release([b, a])
    assert pool.num_cached_blocks == 1 and pool.match_prefix([k(0)]) == [a]
    pool.check_invariants()


def test_prefix_caching_off():
    pool = BlockPool(2, enable_prefix_caching=False)
    [b] = pool.allocate(1)
    pool.cache_block(b, k(0))
    pool.release([b])
    assert pool.match_prefix([k(0)]) == [] and pool.num_cached_blocks == 0
    pool.check_invariants()


class _Seq:
    def __init__(self, tokens):
        self.all_token_ids = tokens
        self.block_table, self.block_keys, self.num_computed_tokens = [], [], 0


def test_manager_prefix_match_leaves_one_token_to_compute():
    pool = BlockPool(8)
    kv = KVCacheManager(pool, block_size=4, model_id="m")
    a = _Seq(list(range(12)))  # exactly 3 blocks
    assert kv.match_prefix(a) == 0
    assert kv.allocate_slots(a, 12) and a.block_table == [0, 1, 2]
    a.num_computed_tokens = 12
    kv.cache_full_blocks(a)
    assert len(a.block_keys) == 3
    b = _Seq(list(range(12)))
    # all 3 blocks are cached, but the last token must be computed for logits: reuse 2 blocks
    assert kv.match_prefix(b) == 8 and b.block_table == [0, 1]
    assert kv.blocks_needed(b, 4) == 1
    kv.free(a)
    kv.free(b)
    pool.check_invariants()
    assert pool.num_used_blocks == 0 and pool.num_cached_blocks == 3


def test_event_queues_each_see_every_event_and_none_are_kept_without_a_reader():
    pool = BlockPool(2)
    [b] = pool.allocate(1)
    pool.cache_block(b, k(0))  # no queue yet: not kept anywhere
    first, second = pool.add_event_queue(), pool.add_event_queue()
    pool.release([b])
    pool.allocate(2)  # evicts k(0)
    assert pool.take_events(first) == [BlockEvicted(k(0), b)]
    assert pool.take_events(first) == []
    assert pool.take_events(second) == [BlockEvicted(k(0), b)]
    assert pool.cached_keys() == []
