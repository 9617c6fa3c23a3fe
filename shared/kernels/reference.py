"""Paged attention in plain torch: the CPU production path and the reference the Triton kernel must match.

The cache of one layer is paged into blocks of `block_size` token slots:

    k_cache: [num_blocks, block_size, Hkv, D]      (dim 0 may be strided: a slice of the engine's
                                                    [num_blocks, layers, 2, block_size, Hkv, D] tensor)
    position i of sequence b  ->  block block_tables[b, i // block_size], slot i % block_size

    block_tables[b] = [7, 2, 9, 0, 0]   seq_len = 40, block_size = 16
                       |  |  |  '--'--- padding, never read
                       |  |  '-------- positions 32..39 (partial block)
                       |  '----------- positions 16..31
                       '-------------- positions  0..15

Speed on CPU comes from three things (measured, see the task report): gathering blocks with
`index_select` on dim 0 (several times faster than advanced indexing, and it never needs dim 0 to be
contiguous), feeding `scaled_dot_product_attention` 4-D tensors (only then does it take the fused
flash kernel, ~5x faster than the math path on a 2000-token prefill), and doing all decode rows of a
batch in one call instead of one call per sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv_cache_torch(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T], slot = block_id * block_size + offset; < 0 = padding, skip
) -> None:
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()  # boolean indexing syncs on GPU; the Triton writer does not
    blocks, offsets = slots // block_size, slots % block_size
    # index_put_ on the [num_blocks, block_size] dims writes through the strided view in place.
    k_cache[blocks, offsets] = k[keep].to(k_cache.dtype)
    v_cache[blocks, offsets] = v[keep].to(v_cache.dtype)


def paged_attention_torch(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks_per_seq]
    seq_lens: torch.Tensor,  # [B], context length including this step's queries
    query_start_loc: torch.Tensor,  # [B+1], cumulative query counts
    scale: float,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
) -> torch.Tensor:  # [T, Hq, D]
    # The hints exist to spare the Triton path a device sync; here the host lists below are needed
    # anyway (per-sequence slicing), so one `.tolist()` each replaces them.
    del max_query_len, max_seq_len
    starts = query_start_loc.tolist()
    ctx_lens = seq_lens.tolist()
    if starts[-1] != q.shape[0]:
        raise ValueError(f"query_start_loc[-1] = {starts[-1]} but q has {q.shape[0]} rows")
    q_lens = [end - start for start, end in zip(starts, starts[1:])]
    block_size = k_cache.shape[1]
    for b, (q_len, ctx_len) in enumerate(zip(q_lens, ctx_lens)):
        if q_len > ctx_len:
            raise ValueError(f"sequence {b}: q_len {q_len} > seq_len {ctx_len}")
    if max(ctx_lens, default=0) > block_tables.shape[1] * block_size:
        raise ValueError(
            f"seq_len {max(ctx_lens)} needs more than the {block_tables.shape[1]} blocks "
            f"of {block_size} slots that block_tables has room for"
        )

    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    decode_seqs = [b for b, n in enumerate(q_lens) if n == 1]
    for group in _length_groups(decode_seqs, ctx_lens):
        _decode(q, k_cache, v_cache, block_tables, seq_lens, starts, ctx_lens, group, scale, out)
    for b, q_len in enumerate(q_lens):
        if q_len > 1:
            rows = slice(starts[b], starts[b] + q_len)
            out[rows] = _prefill(q[rows], k_cache, v_cache, block_tables[b], ctx_lens[b], scale)
    return out


def _length_groups(seqs: list[int], ctx_lens: list[int], slack: int = 512) -> list[list[int]]:
    """Split decode sequences into groups of similar context length. One batched call pads every
    sequence to the group's longest: 8 chats at 300 tokens beside one at 2,600 would read 2,600
    keys each (a 2.6x longer step). A new group starts when a sequence is over twice (and over
    `slack` tokens) longer than the shortest in the current group; usually there is one group."""
    groups: list[list[int]] = []
    floor = None
    for b in sorted(seqs, key=lambda b: ctx_lens[b]):
        if floor is None or ctx_lens[b] > max(2 * floor, floor + slack):
            groups.append([])
            floor = ctx_lens[b]
        groups[-1].append(b)
    return groups


def _decode(q, k_cache, v_cache, block_tables, seq_lens, starts, ctx_lens, seqs, scale, out) -> None:
    """All single-query sequences at once: one gather, one fused attention call."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_heads = q.shape[1]
    group = num_heads // num_kv_heads
    n = len(seqs)
    num_blocks = -(-max(ctx_lens[b] for b in seqs) // block_size)
    if n == len(ctx_lens):  # the common pure-decode step: rows and sequences already line up
        rows, tables, lens = None, block_tables[:, :num_blocks], seq_lens
    else:
        seq_idx = torch.tensor(seqs, device=q.device)
        rows = torch.tensor([starts[b] for b in seqs], device=q.device)
        tables = block_tables.index_select(0, seq_idx)[:, :num_blocks]
        lens = seq_lens.index_select(0, seq_idx)

    # Padding entries past a sequence's last block may hold anything (even -1): point them at block 0,
    # whose keys the length mask hides.
    used = torch.arange(num_blocks, device=q.device) < (lens[:, None] + block_size - 1) // block_size
    tables = torch.where(used, tables, 0).flatten()  # [n * num_blocks]
    keys = num_blocks * block_size
    # [n * num_blocks, bs, Hkv, D] -> [n, keys, Hkv, D] -> [n, Hkv, keys, D] (strided view, no copy)
    # (a bf16/fp16 cache under fp32 queries is widened here, as it is read)
    k = k_cache.index_select(0, tables).to(q.dtype).view(n, keys, num_kv_heads, head_dim).transpose(1, 2)
    v = v_cache.index_select(0, tables).to(q.dtype).view(n, keys, num_kv_heads, head_dim).transpose(1, 2)
    valid = torch.arange(keys, device=q.device) < lens[:, None]  # [n, keys]

    # GQA without copies: the `group` query heads of one kv head become that head's query rows,
    #   q: [n, Hq, D] -> [n, Hkv, group, D]   (head h = kv_head * group + g)
    q_dec = q if rows is None else q.index_select(0, rows)
    q_dec = q_dec.reshape(n, num_kv_heads, group, head_dim)
    o = F.scaled_dot_product_attention(q_dec, k, v, attn_mask=valid[:, None, None, :], scale=scale)
    o = o.reshape(n, num_heads, head_dim)
    if rows is None:
        out.copy_(o)
    else:
        out.index_copy_(0, rows, o)


def _prefill(
    q: torch.Tensor,  # [q_len, Hq, D], the last q_len positions of the sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [max_blocks_per_seq]
    ctx_len: int,
    scale: float,
) -> torch.Tensor:  # [q_len, Hq, D]
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    q_len = q.shape[0]
    num_blocks = -(-ctx_len // block_size)
    blocks = block_table[:num_blocks]
    # [num_blocks, bs, Hkv, D] -> [ctx, Hkv, D] -> [1, Hkv, ctx, D]
    k = k_cache.index_select(0, blocks).to(q.dtype).view(-1, num_kv_heads, head_dim)[:ctx_len]
    v = v_cache.index_select(0, blocks).to(q.dtype).view(-1, num_kv_heads, head_dim)[:ctx_len]
    k, v = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if q_len == ctx_len:
        mask, causal = None, True  # SDPA's causal mask is top-left aligned: right only without a prefix
    else:
        # Query j sits at position ctx_len - q_len + j and sees positions 0..that (bottom-right causal).
        #        keys ->  0 1 2 3 4 5      (ctx_len 6, q_len 3: three cached, three new)
        #   query 0 (p=3) x x x x . .
        #   query 1 (p=4) x x x x x .
        #   query 2 (p=5) x x x x x x
        key_pos = torch.arange(ctx_len, device=q.device)
        query_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)
        mask, causal = key_pos[None, :] <= query_pos[:, None], False  # [q_len, ctx]
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
    )  # [1, Hq, q_len, D]
    return o[0].transpose(0, 1)
