"""Paged attention: torch reference vs a naive float64 loop, Triton (interpreted on CPU) vs the reference.

Every batch uses a shuffled block assignment, block-table padding that points out of range (it must
never be read), caches that are strided along dim 0 (one layer's slice of a bigger
[num_blocks, layers, 2, block_size, Hkv, D] tensor) and random garbage in unused slots.
"""

import os

# Must precede the first `import triton` anywhere: @triton.jit picks interpreter vs compiler when it runs.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from shared.kernels import paged_attention, write_kv_cache

NUM_LAYERS = 3
LAYER = 1

# name -> [(seq_len, q_len), ...] per sequence of the batch (block_size 16 unless the case says so)
CASES = {
    "decode_one_block": [(5, 1), (16, 1), (1, 1)],  # partial, exactly full, single token
    "decode_many_blocks": [(70, 1), (33, 1), (128, 1), (17, 1)],  # different lengths; 128 = 8 full blocks
    "prefill_plain": [(37, 37)],
    "prefill_block_multiple": [(32, 32)],
    "prefill_chunk_aligned_prefix": [(50, 18)],  # 32 cached = 2 full blocks, chunk ends mid-block
    "prefill_chunk_unaligned_prefix": [(45, 20)],  # 25 cached: the chunk starts mid-block
    "mixed": [(40, 1), (64, 20), (23, 23), (90, 1), (17, 5)],
    "long_chunk_many_query_tiles": [(300, 130), (200, 1)],  # > 64 query rows: several Triton tiles
}
GQA = [(4, 4), (6, 2), (8, 2)]  # (Hq, Hkv): ratios 1, 3, 4


def make_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, gen):
    """k_cache, v_cache: [num_blocks, block_size, Hkv, D], strided along dim 0, full of garbage."""
    kv = torch.randn(num_blocks, NUM_LAYERS, 2, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    k_cache, v_cache = kv[:, LAYER, 0], kv[:, LAYER, 1]
    assert not k_cache.is_contiguous()
    return kv, k_cache, v_cache


def make_batch(specs, block_size, num_heads, num_kv_heads, head_dim, dtype=torch.float32, seed=0):
    """A random batch over a shuffled block assignment; returns the paged_attention arguments."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-seq_len // block_size) for seq_len, _ in specs]
    num_blocks = sum(blocks_per_seq) + 5  # a few blocks nobody owns
    _, k_cache, v_cache = make_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, gen)
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(blocks_per_seq) + 2
    # Padding entries point out of range: reading one would crash (or, on GPU, read garbage).
    block_tables = torch.full((len(specs), width), num_blocks + 7, dtype=torch.int32)
    for b, n in enumerate(blocks_per_seq):
        block_tables[b, :n] = torch.tensor(ids[:n])
        ids = ids[n:]
    seq_lens = torch.tensor([s for s, _ in specs], dtype=torch.int32)
    q_lens = torch.tensor([n for _, n in specs])
    query_start_loc = torch.cat([torch.zeros(1), q_lens.cumsum(0)]).to(torch.int32)
    q = torch.randn(int(q_lens.sum()), num_heads, head_dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, head_dim**-0.5


def naive_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale):
    """Obviously correct: gather keys one position at a time, explicit causal softmax in float64."""
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    kv_head = torch.arange(q.shape[1]) // (q.shape[1] // num_kv_heads)  # [Hq] kv head of each query head
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(len(seq_lens)):
        start, end, seq_len = int(query_start_loc[b]), int(query_start_loc[b + 1]), int(seq_lens[b])
        where = [(int(block_tables[b, i // block_size]), i % block_size) for i in range(seq_len)]
        keys = torch.stack([k_cache[blk, off] for blk, off in where]).double()  # [seq_len, Hkv, D]
        values = torch.stack([v_cache[blk, off] for blk, off in where]).double()
        for j in range(end - start):
            pos = seq_len - (end - start) + j  # absolute position of this query
            k = keys[: pos + 1, kv_head]  # [pos+1, Hq, D]
            v = values[: pos + 1, kv_head]
            scores = torch.einsum("phd,hd->hp", k, q[start + j].double()) * scale  # [Hq, pos+1]
            weights = torch.exp(scores - scores.max(dim=1, keepdim=True).values)
            weights = weights / weights.sum(dim=1, keepdim=True)
            out[start + j] = torch.einsum("hp,phd->hd", weights, v)
    return out


def host_hints(seq_lens, query_start_loc):
    return {
        "max_query_len": int((query_start_loc[1:] - query_start_loc[:-1]).max()),
        "max_seq_len": int(seq_lens.max()),
    }


@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"hq{h[0]}_hkv{h[1]}")
@pytest.mark.parametrize("case", CASES)
def test_torch_reference_matches_naive(case, heads):
    args = make_batch(CASES[case], 16, *heads, head_dim=32)
    out = paged_attention(*args, backend="torch")
    assert out.shape == args[0].shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), naive_attention(*args), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [1, 8, 32])
def test_torch_reference_other_block_sizes(block_size):
    args = make_batch(CASES["mixed"], block_size, 6, 2, head_dim=24)
    out = paged_attention(*args)  # CPU tensors: the default backend is torch
    torch.testing.assert_close(out.double(), naive_attention(*args), atol=2e-5, rtol=1e-5)


def test_torch_reference_production_shape():
    """SmolLM2-135M heads (Hq 9, Hkv 3, D 64), bf16 like the engine may run it; fp32 math inside."""
    args = make_batch(CASES["mixed"], 16, 9, 3, head_dim=64, dtype=torch.bfloat16)
    out = paged_attention(*args)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), naive_attention(*args), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"hq{h[0]}_hkv{h[1]}")
@pytest.mark.parametrize("case", CASES)
def test_triton_matches_reference(case, heads):
    pytest.importorskip("triton")
    args = make_batch(CASES[case], 16, *heads, head_dim=32)
    expected = paged_attention(*args, backend="torch")
    out = paged_attention(*args, backend="triton", **host_hints(args[4], args[5]))
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size, head_dim", [(8, 24), (32, 16)])
def test_triton_other_block_sizes_without_hints(block_size, head_dim):
    """Blocks smaller and larger than the kernel's key tile, a head_dim that is not a power of two."""
    pytest.importorskip("triton")
    args = make_batch(CASES["mixed"], block_size, 6, 2, head_dim=head_dim)
    expected = paged_attention(*args, backend="torch")
    torch.testing.assert_close(paged_attention(*args, backend="triton"), expected, atol=2e-5, rtol=1e-5)


def test_triton_fp16():
    pytest.importorskip("triton")
    args = make_batch(CASES["mixed"], 16, 6, 2, head_dim=32, dtype=torch.float16)
    out = paged_attention(*args, backend="triton")
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.double(), naive_attention(*args), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_write_kv_cache_skips_padding_and_touches_nothing_else(backend):
    if backend == "triton":
        pytest.importorskip("triton")
    block_size, num_kv_heads, head_dim, num_blocks = 4, 2, 8, 6
    gen = torch.Generator().manual_seed(1)
    kv, k_cache, v_cache = make_cache(num_blocks, block_size, num_kv_heads, head_dim, torch.float32, gen)
    before = kv.clone()
    slots = torch.tensor([5, -1, 0, 23, -1, 9], dtype=torch.int64)  # 23 = last slot of the last block
    k = torch.randn(len(slots), num_kv_heads, head_dim, generator=gen)
    v = torch.randn(len(slots), num_kv_heads, head_dim, generator=gen)

    write_kv_cache(k, v, k_cache, v_cache, slots.to(torch.int32), backend=backend)

    expected = before.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[slot // block_size, LAYER, 0, slot % block_size] = k[t]
            expected[slot // block_size, LAYER, 1, slot % block_size] = v[t]
    assert torch.equal(kv, expected)  # other slots, other layers untouched
    assert not torch.equal(kv, before)


def test_write_then_decode_equals_longer_prefill():
    """The engine's loop: prefill n tokens, write token n+1, decode it; same as prefilling n+1 tokens."""
    block_size, num_heads, num_kv_heads, head_dim, n = 4, 6, 2, 16, 13
    gen = torch.Generator().manual_seed(2)
    _, k_cache, v_cache = make_cache(8, block_size, num_kv_heads, head_dim, torch.float32, gen)
    q = torch.randn(n + 1, num_heads, head_dim, generator=gen)
    k, v = torch.randn(2, n + 1, num_kv_heads, head_dim, generator=gen)
    blocks = [6, 1, 3, 7]
    block_tables = torch.tensor([blocks], dtype=torch.int32)
    slots = torch.tensor([blocks[i // block_size] * block_size + i % block_size for i in range(n + 1)])

    write_kv_cache(k[:n], v[:n], k_cache, v_cache, slots[:n])
    write_kv_cache(k[n:], v[n:], k_cache, v_cache, slots[n:])
    decode = paged_attention(
        q[n:], k_cache, v_cache, block_tables, torch.tensor([n + 1], dtype=torch.int32),
        torch.tensor([0, 1], dtype=torch.int32), head_dim**-0.5,
    )
    prefill = paged_attention(
        q, k_cache, v_cache, block_tables, torch.tensor([n + 1], dtype=torch.int32),
        torch.tensor([0, n + 1], dtype=torch.int32), head_dim**-0.5,
    )
    torch.testing.assert_close(decode, prefill[n:], atol=1e-6, rtol=1e-6)


def _valid_args():
    return list(make_batch(CASES["mixed"], 16, 6, 2, head_dim=16))


# name -> (position of the argument in paged_attention's signature, how to break it, expected error)
BAD_INPUTS = {
    "q_2d": (0, lambda q: q[:, 0], r"q must be \[T, Hq, D\]"),
    "head_dim": (0, lambda q: q[..., :8], r"head_dim of q \(8\) != head_dim of the cache \(16\)"),
    "gqa_ratio": (0, lambda q: q[:, :5], r"Hq \(5\) must be a multiple of Hkv \(2\)"),
    "q_dtype": (0, lambda q: q.double(), r"q is torch.float64 but the cache is torch.float32"),
    "cache_3d": (1, lambda c: c[0], r"k_cache must be \[num_blocks, block_size, Hkv, D\]"),
    "cache_shapes": (2, lambda c: c[:, :8], r"v_cache \[.*\] and k_cache \[.*\] differ in shape"),
    "cache_strides": (1, lambda c: c.transpose(2, 3).contiguous().transpose(2, 3), r"k_cache must be dense"),
    "table_dtype": (3, lambda t: t.float(), r"block_tables must be int32 or int64"),
    "seq_lens_len": (4, lambda s: s[:-1], r"seq_lens must have shape \[5\]"),
    "qsl_len": (5, lambda s: s[:-1], r"query_start_loc must have shape \[6\]"),
}


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_paged_attention_rejects_bad_inputs(name):
    index, break_it, message = BAD_INPUTS[name]
    args = _valid_args()
    args[index] = break_it(args[index])
    with pytest.raises(ValueError, match=message):
        paged_attention(*args)


def test_paged_attention_rejects_bad_backend_and_hint():
    args = _valid_args()
    with pytest.raises(ValueError, match="backend must be one of"):
        paged_attention(*args, backend="cuda")
    with pytest.raises(ValueError, match="max_seq_len 1000 exceeds"):
        paged_attention(*args, max_seq_len=1000)


def test_write_kv_cache_rejects_bad_inputs():
    _, k_cache, v_cache = make_cache(4, 4, 2, 8, torch.float32, torch.Generator().manual_seed(3))
    k = v = torch.zeros(3, 2, 8)
    slots = torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match=r"k must be \[T, 2, 8\] to match the cache"):
        write_kv_cache(k[:, :1], v, k_cache, v_cache, slots)
    with pytest.raises(ValueError, match=r"slot_mapping must have shape \[3\]"):
        write_kv_cache(k, v, k_cache, v_cache, slots[:2])
    with pytest.raises(ValueError, match="slot_mapping must be int32 or int64"):
        write_kv_cache(k, v, k_cache, v_cache, slots.float())


def test_decode_rows_of_very_different_lengths_are_grouped():
    """Short decodes beside a long one (and a prefill chunk) run as separate length groups: same
    answers as the naive attention, in the right rows."""
    from shared.kernels.reference import _length_groups

    specs = [(30, 1), (1200, 1), (25, 1), (40, 7), (700, 1), (33, 1)]
    assert _length_groups([0, 1, 2, 4, 5], [s for s, _ in specs]) == [[2, 0, 5], [4, 1]]
    args = make_batch(specs, 16, 6, 2, head_dim=16)
    out = paged_attention(*args, backend="torch")
    torch.testing.assert_close(out.double(), naive_attention(*args), atol=2e-5, rtol=1e-5)
