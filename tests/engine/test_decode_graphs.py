"""The CUDA path's decode graphs: a step of n sequences replayed at the next bucket size, padded, equals
the eager step. Here (no GPU) the graphs are the captured function itself, run on the same static
buffers, so what is tested is what capture cannot hide: the bucketing, the copy-in, and padding rows
that neither change a real row nor write the cache."""

from __future__ import annotations

import pytest
import torch

from shared.engine.decode_graphs import DecodeGraphs, buckets_up_to, eager_capture
from shared.engine.model_runner import ModelRunner, ScheduledChunk
from shared.kvcache.kv_cache import KVCache
from tests.model_utils import tiny_model

BS = 16


def test_buckets_cover_every_batch_size_up_to_the_largest():
    assert buckets_up_to(1) == [1]
    assert buckets_up_to(3) == [1, 2, 3]
    assert buckets_up_to(8) == [1, 2, 4, 8]
    assert buckets_up_to(30) == [1, 2, 4, 8, 16, 24, 30]
    assert buckets_up_to(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]


@pytest.mark.parametrize("n", [1, 3, 5, 8])
def test_a_padded_graph_step_equals_the_eager_step_and_writes_only_its_rows(n):
    model = tiny_model(seed=5)
    cfg = model.config
    g = torch.Generator().manual_seed(n)
    eager_kv = KVCache(cfg, 64, BS, dtype=torch.float32)
    eager = ModelRunner(model, eager_kv, fused=False)
    # n sequences of different lengths on scattered blocks (block 0 among them: padding rows read it)
    free = torch.randperm(64, generator=g).tolist()
    lengths = torch.randint(1, 70, (n,), generator=g).tolist()
    tables = [[free.pop() for _ in range(-(-(length + 3) // BS))] for length in lengths]  # room for 3 steps
    if not any(0 in t for t in tables):
        tables[0][0] = 0
    prompts = [torch.randint(0, cfg.vocab_size, (length,), generator=g).tolist() for length in lengths]
    eager.execute([ScheduledChunk(p, 0, t) for p, t in zip(prompts, tables)])

    graph_kv = KVCache(cfg, 64, BS, dtype=torch.float32)
    graph_kv.data.copy_(eager_kv.data)
    graphs = DecodeGraphs(model, graph_kv, max_batch=8, max_blocks=8, capture=eager_capture)
    assert torch.equal(graph_kv.data, eager_kv.data), "capture wrote into the cache"
    for step in range(3):  # the buffers' earlier contents (other widths, other rows) must not leak in
        chunks = [ScheduledChunk([int(torch.randint(0, cfg.vocab_size, (1,), generator=g))], length + step, t)
                  for length, t in zip(lengths, tables)]
        assert graphs.accepts(chunks)
        got = graphs.run(chunks)
        want = eager.execute(chunks)
        assert got.shape == want.shape == (n, cfg.vocab_size)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(graph_kv.data, eager_kv.data, rtol=1e-5, atol=1e-5)
    written = (eager_kv.data != 0).flatten(1).any(1).nonzero().flatten().tolist()
    assert sorted(written) == sorted({b for t in tables for b in t}), "only the sequences' blocks hold keys"


def test_steps_the_graphs_do_not_take_run_eagerly():
    model = tiny_model(seed=5)
    graphs = DecodeGraphs(model, KVCache(model.config, 16, BS, dtype=torch.float32), max_batch=4, max_blocks=2,
                          capture=eager_capture)
    one = ScheduledChunk([1], 3, [0])
    assert graphs.accepts([one] * 4)
    assert not graphs.accepts([one] * 5)  # over the largest bucket
    assert not graphs.accepts([ScheduledChunk([1, 2], 3, [0])])  # a prefill chunk
    assert not graphs.accepts([ScheduledChunk([1], 3, [0], num_logits=2)])  # speculative verification
    assert not graphs.accepts([ScheduledChunk([1], 40, [0, 1, 2])])  # longer than the tables hold
