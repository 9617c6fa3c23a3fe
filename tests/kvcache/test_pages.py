"""Faulting KV memory in ahead of use: which pages become resident, and that no byte changes."""

from __future__ import annotations

import ctypes
import mmap
import sys

import numpy as np
import pytest
import torch

from shared.kvcache.block_pool import BlockPool
from shared.kvcache.kv_cache import KVCache
from shared.kvcache.pages import PAGE, WarmAhead, populate
from tests.model_utils import tiny_config

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_POPULATE_WRITE) is Linux's")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def _kernel_populates() -> bool:
    mem = mmap.mmap(-1, PAGE)
    return populate(np.frombuffer(mem, dtype=np.uint8).ctypes.data, PAGE)


# where the kernel has no MADV_POPULATE_WRITE (Linux < 5.14) the warm-ahead is off (the last test)
needs_populate = pytest.mark.skipif(not _kernel_populates(), reason="this kernel cannot populate (Linux < 5.14)")


def resident(address: int, length: int) -> np.ndarray:
    """Per page of [address, address + length): is it resident (mincore)?"""
    pages = -(-length // PAGE)
    vec = ctypes.create_string_buffer(pages)
    assert _libc.mincore(address, pages * PAGE, vec) == 0, ctypes.get_errno()
    return np.frombuffer(vec.raw, dtype=np.uint8) & 1 == 1


@needs_populate
def test_populate_makes_pages_resident_and_changes_no_byte():
    mem = mmap.mmap(-1, 64 * PAGE)
    buf = np.frombuffer(mem, dtype=np.uint8)
    buf[5 * PAGE:5 * PAGE + 3] = [7, 8, 9]  # page 5 is touched, with data
    assert resident(buf.ctypes.data, 64 * PAGE).sum() == 1
    assert populate(buf.ctypes.data + 3 * PAGE + 17, 4 * PAGE)  # not page-aligned: widened to pages 3..7
    assert np.flatnonzero(resident(buf.ctypes.data, 64 * PAGE)).tolist() == [3, 4, 5, 6, 7]
    assert buf[5 * PAGE:5 * PAGE + 3].tolist() == [7, 8, 9] and buf.sum() == 24


@needs_populate
def test_warm_ahead_keeps_the_blocks_past_the_highest_used_resident_and_no_more():
    block, blocks = 3 * PAGE, 40
    mem = mmap.mmap(-1, block * blocks)
    address = np.frombuffer(mem, dtype=np.uint8).ctypes.data
    warm = WarmAhead(address, block, blocks, ahead=4)
    try:
        assert warm.wait(10)
        assert resident(address, block * blocks).sum() == 4 * 3  # blocks 0-3 at start
        warm.need(10)  # blocks [0, 10) handed out: 10-13 next
        assert warm.wait(10) and warm.done == 14
        assert np.flatnonzero(resident(address, block * blocks)).tolist() == list(range(14 * 3))
        warm.need(38)  # never past the end
        assert warm.wait(10) and warm.done == blocks
    finally:
        warm.close()


def test_the_block_pool_reports_each_new_high_water_once():
    seen = []
    pool = BlockPool(16, on_grow=seen.append)
    first = pool.allocate(3)
    assert first == [0, 1, 2] and seen == [3] and pool.high_water == 3
    pool.release(first[::-1])
    assert pool.allocate(2) == [0, 1] and seen == [3]  # reused blocks: nothing new touched
    pool.allocate(4)  # 2, then 3, 4, 5 (never used)
    assert seen == [3, 6] and pool.high_water == 6


@needs_populate
def test_an_engine_cache_faults_in_ahead_of_its_allocator():
    cache = KVCache(tiny_config(), num_blocks=64, dtype=torch.bfloat16, warm_ahead=8)
    pool = BlockPool(64, on_grow=cache.warm)
    assert cache.block_bytes % PAGE == 0, "the check below counts whole pages per block"
    per_block = cache.block_bytes // PAGE
    assert cache._warm.wait(10)
    assert resident(cache.data.data_ptr(), cache.block_bytes * 64).sum() == 8 * per_block
    blocks = pool.allocate(20)
    assert cache._warm.wait(10)
    assert resident(cache.data.data_ptr(), cache.block_bytes * 64).sum() == 28 * per_block
    incoming = torch.randn(len(blocks), *cache.data.shape[1:]).to(torch.bfloat16)
    cache.write_blocks(blocks, incoming)
    assert torch.equal(cache.read_blocks(blocks), incoming)
    assert not cache.data[28:].any()


def test_where_the_kernel_cannot_populate_the_thread_stops_and_nothing_waits(monkeypatch):
    import shared.kvcache.pages as pages

    monkeypatch.setattr(pages, "populate", lambda address, length: False)  # no MADV_POPULATE_WRITE here
    mem = mmap.mmap(-1, 8 * PAGE)
    warm = WarmAhead(np.frombuffer(mem, dtype=np.uint8).ctypes.data, PAGE, 8, ahead=4)
    assert warm.wait(10) and warm.done == 0
    warm.need(6)  # after the thread stopped: a no-op, never a hang
    assert warm.wait(1)
    warm._thread.join(10)
    assert not warm._thread.is_alive()
