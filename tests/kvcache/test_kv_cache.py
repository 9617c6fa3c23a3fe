"""The paged KV cache's export and import: whole blocks out of and into scattered slots."""

from __future__ import annotations

import torch

from shared.kvcache.kv_cache import KVCache
from tests.model_utils import tiny_config


def test_blocks_copied_out_and_in_at_scattered_ids_leave_the_others_alone():
    cache = KVCache(tiny_config(), num_blocks=16, dtype=torch.bfloat16)
    cache.data.copy_(torch.randn(cache.data.shape))
    before = cache.data.clone()
    ids = [9, 2, 14, 5]
    out = cache.read_blocks(ids)
    assert out.shape == (4, *cache.data.shape[1:]) and out.is_contiguous()
    assert torch.equal(out, before[ids])
    out.zero_()  # a copy: the cache keeps its blocks
    assert torch.equal(cache.data, before)

    incoming = torch.randn(3, *cache.data.shape[1:])  # float32 in, stored as the cache's bfloat16
    cache.write_blocks([7, 0, 11], incoming)
    assert torch.equal(cache.data[[7, 0, 11]], incoming.to(torch.bfloat16))
    untouched = [i for i in range(16) if i not in (7, 0, 11)]
    assert torch.equal(cache.data[untouched], before[untouched])
