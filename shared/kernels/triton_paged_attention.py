"""Paged attention as a Triton kernel (CUDA; on CPU only under TRITON_INTERPRET=1, for tests).

This module imports triton at the top: `ops` imports it lazily, so `shared.kernels` loads where
triton is missing, and TRITON_INTERPRET (read when `@triton.jit` runs) can be set before that.

One program per (sequence, tile of BLOCK_Q query tokens, kv head), in the style of vLLM's unified
attention. The tile's rows are its query tokens crossed with the `group` query heads that share the
kv head, so each key/value tile loaded from the cache serves all of them (GQA without copies):

    row r  ->  token q_tile * BLOCK_Q + r // GROUP_PAD,  head kv_head * GROUP + r % GROUP_PAD
    GROUP = 3, GROUP_PAD = 4:   r = 0 1 2 3 | 4 5 6 7 | ...
                                tok 0 0 0 0 | 1 1 1 1
                                g   0 1 2 x | 0 1 2 x     (x: padding row, masked)

The program walks the keys 0..(last position of its tile) in tiles of TILE_N, looks each key's block
up in the block table (so TILE_N need not equal block_size), and keeps an online softmax (running
max m, running sum l, rescaled accumulator) in fp32. Decode rows are tiles with q_len == 1.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# exp2 is the native instruction; fold log2(e) into the scale once.
_LOG2_E = 1.4426950408889634


@triton.jit
def _paged_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    scale_log2,  # softmax scale * log2(e)
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_bt,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,  # BLOCK_D = next power of two >= HEAD_DIM
    BLOCK_SIZE: tl.constexpr,  # cache slots per block
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,  # query heads per kv head, padded to a power of 2
    BLOCK_Q: tl.constexpr,  # query tokens per program; BLOCK_Q * GROUP_PAD rows
    TILE_N: tl.constexpr,  # keys per loop step
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs, None (backend default) otherwise
):
    seq = tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return  # the grid is sized for the longest query of the batch
    seq_len = tl.load(seq_lens_ptr + seq)
    num_cached = seq_len - q_len  # positions before this step's first query

    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    tok = q_tile * BLOCK_Q + rows // GROUP_PAD  # [M] query index within the sequence
    g = rows % GROUP_PAD
    row_ok = (tok < q_len) & (g < GROUP)
    # [M] absolute position of each row. Every row, padding included, sees key 0 in the first tile, so
    # no running max stays -inf (exp2(-inf - -inf) would be nan); padding rows are never stored.
    q_pos = num_cached + tok
    head = kv_head * GROUP + g
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM

    q_offs = (q_start + tok)[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [M, BLOCK_D]

    m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, BLOCK_D], tl.float32)

    # Keys past the tile's last query position are masked for every row: stop there.
    kv_end = num_cached + tl.minimum((q_tile + 1) * BLOCK_Q, q_len)
    for start in range(0, kv_end, TILE_N):
        pos = start + tl.arange(0, TILE_N)  # [N] key positions
        pos_ok = pos < kv_end
        # Masked loads keep padding entries of the block table (any value) out of the address math.
        block = tl.load(block_tables_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=pos_ok, other=0)
        slot = pos % BLOCK_SIZE
        kv_mask = pos_ok[:, None] & d_ok[None, :]
        # int64: block * stride_kb overflows int32 for caches past 2^31 elements.
        k_offs = block[:, None].to(tl.int64) * stride_kb + slot[:, None] * stride_kt + kv_head * stride_kh
        k = tl.load(k_cache_ptr + k_offs + d[None, :], mask=kv_mask, other=0.0)  # [N, BLOCK_D]

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [M, N]
        s = tl.where(pos[None, :] <= q_pos[:, None], s, float("-inf"))  # causal (also hides pos >= kv_end)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)  # rescales what was summed under the old max; 0 on the first step
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)

        v_offs = block[:, None].to(tl.int64) * stride_vb + slot[:, None] * stride_vt + kv_head * stride_vh
        v = tl.load(v_cache_ptr + v_offs + d[None, :], mask=kv_mask, other=0.0)  # [N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    o = acc / l_i[:, None]
    o_offs = (q_start + tok)[:, None].to(tl.int64) * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(out_ptr + o_offs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _write_kv_cache_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kct, stride_vcb, stride_vct,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_HD: tl.constexpr,  # next power of two >= NUM_KV_HEADS * HEAD_DIM
):
    """One program per token: copy its [Hkv, D] key and value into their slot."""
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:
        return  # padding token: the branch on device is what spares the torch path's host sync
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    i = tl.arange(0, BLOCK_HD)
    h = i // HEAD_DIM
    d = i % HEAD_DIM
    ok = i < NUM_KV_HEADS * HEAD_DIM
    # Within a block, [Hkv, D] is contiguous (checked by the wrapper): slot row index is just i.
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=ok)
    tl.store(k_cache_ptr + block * stride_kcb + offset * stride_kct + i, k, mask=ok)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=ok)
    tl.store(v_cache_ptr + block * stride_vcb + offset * stride_vct + i, v, mask=ok)


def _check_launchable(x: torch.Tensor) -> None:
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "triton backend needs CUDA tensors, or TRITON_INTERPRET=1 set before triton is imported"
        )


def paged_attention_triton(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks_per_seq]
    seq_lens: torch.Tensor,  # [B]
    query_start_loc: torch.Tensor,  # [B+1]
    scale: float,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
) -> torch.Tensor:  # [T, Hq, D]
    _check_launchable(q)
    del max_seq_len  # the kernel reads each sequence's length on device; no host value needed
    num_seqs = block_tables.shape[0]
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_heads = q.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.shape[0] == 0 or num_seqs == 0:
        return out
    if max_query_len is None:  # one device sync; callers that know it pass it in
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())

    group_pad = triton.next_power_of_2(group)
    # tl.dot wants >= 16 rows: decode tiles fill them with heads, prefill tiles with 64 rows of tokens.
    rows = 16 if max_query_len == 1 else 64
    block_q = max(1, rows // group_pad)
    grid = (num_seqs, triton.cdiv(max_query_len, block_q), num_kv_heads)
    _paged_attention_kernel[grid](
        out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        scale * _LOG2_E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size, GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, TILE_N=32,
        # fp32 caches are a test/debug setting: exact fp32 dots (slow FMA path on GPU) beat tf32's 1e-3.
        # For 16-bit inputs the backend default applies (tf32 is not even accepted on every target).
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,
    )
    return out


def write_kv_cache_triton(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T]
) -> None:
    _check_launchable(k)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _write_kv_cache_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_HD=triton.next_power_of_2(num_kv_heads * head_dim),
    )
