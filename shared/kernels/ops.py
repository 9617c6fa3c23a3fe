"""Public paged-attention ops: check shapes, dtypes and strides, then pick an implementation.

Both implementations share one signature (see `reference.py` for the cache layout):
  - "torch":  `reference.py`, the CPU production path;
  - "triton": `triton_paged_attention.py`, the CUDA path (or any device under TRITON_INTERPRET=1).
The default is triton for CUDA tensors when triton is installed, torch otherwise.

The checks below only read shapes and strides (no device syncs), so they are cheap enough to run on
every call of every layer.
"""

from __future__ import annotations

import importlib.util
from typing import Protocol

import torch

from shared.kernels.reference import paged_attention_torch, write_kv_cache_torch

BACKENDS = ("torch", "triton")
_HAS_TRITON = importlib.util.find_spec("triton") is not None
_INDEX_DTYPES = (torch.int32, torch.int64)


class PagedAttentionImpl(Protocol):
    """The signature `paged_attention_torch` and `paged_attention_triton` share (inputs already checked)."""

    def __call__(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
        seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, *,
        max_query_len: int | None = None, max_seq_len: int | None = None,
    ) -> torch.Tensor: ...


def write_kv_cache(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int32/int64; slot = block_id * block_size + offset, < 0 = skip
    *,
    backend: str | None = None,
) -> None:
    """Write each token's key and value into its cache slot, in place; tokens with slot < 0 are skipped."""
    _check_cache(k_cache, v_cache)
    _, _, num_kv_heads, head_dim = k_cache.shape
    for name, x in (("k", k), ("v", v)):
        if x.dim() != 3 or x.shape[1:] != (num_kv_heads, head_dim):
            raise ValueError(
                f"{name} must be [T, {num_kv_heads}, {head_dim}] to match the cache, got {_shape(x)}"
            )
        if not x.dtype.is_floating_point:
            raise ValueError(f"{name} must be a floating point tensor, got {x.dtype}")
        if x.stride(2) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim, got strides {x.stride()}")
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"k has {k.shape[0]} tokens but v has {v.shape[0]}")
    _check_index("slot_mapping", slot_mapping, (k.shape[0],))
    _check_devices(k, v=v, k_cache=k_cache, slot_mapping=slot_mapping)
    if _pick_backend(backend, k) == "triton":
        from shared.kernels.triton_paged_attention import write_kv_cache_triton

        write_kv_cache_triton(k.to(k_cache.dtype), v.to(k_cache.dtype), k_cache, v_cache, slot_mapping)
    else:
        write_kv_cache_torch(k, v, k_cache, v_cache, slot_mapping)


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [B] int32, context length including this step's q_len_b queries
    query_start_loc: torch.Tensor,  # [B+1] int32, sequence b owns q rows [qsl[b], qsl[b+1])
    scale: float,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    backend: str | None = None,
) -> torch.Tensor:  # [T, Hq, D], dtype of q
    """Causal attention of each sequence's new queries over its paged cache (decode, prefill, mixed).

    Query row j of sequence b sits at position seq_lens[b] - q_len_b + j and attends to cache positions
    0..that position; query head h reads kv head h // (Hq // Hkv). Softmax and sums are fp32.
    `max_query_len` / `max_seq_len` are optional host-side hints that spare the Triton path a sync.
    `backend`: None = triton for CUDA tensors (if installed), torch otherwise; "triton" on CPU tensors
    needs TRITON_INTERPRET=1 (tests).
    """
    _check_cache(k_cache, v_cache)
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    if q.dim() != 3:
        raise ValueError(f"q must be [T, Hq, D], got {_shape(q)}")
    if q.shape[2] != head_dim:
        raise ValueError(f"head_dim of q ({q.shape[2]}) != head_dim of the cache ({head_dim})")
    if q.shape[1] % num_kv_heads != 0:
        raise ValueError(f"Hq ({q.shape[1]}) must be a multiple of Hkv ({num_kv_heads}) for GQA")
    if not q.dtype.is_floating_point:
        raise ValueError(f"q must be a floating point tensor, got {q.dtype}")
    chosen = _pick_backend(backend, q)
    # fp32 queries over a bf16/fp16 cache (the CPU path: keys and values are widened as they are read);
    # the Triton kernel wants one dtype
    if q.dtype != k_cache.dtype and (chosen == "triton" or q.dtype != torch.float32):
        raise ValueError(f"q is {q.dtype} but the cache is {k_cache.dtype}")
    if q.stride(2) != 1:
        raise ValueError(f"q must be contiguous in its last dim, got strides {q.stride()}")
    if block_tables.dim() != 2:
        raise ValueError(f"block_tables must be [B, max_blocks_per_seq], got {_shape(block_tables)}")
    num_seqs = block_tables.shape[0]
    _check_index("block_tables", block_tables, (num_seqs, block_tables.shape[1]))
    _check_index("seq_lens", seq_lens, (num_seqs,))
    _check_index("query_start_loc", query_start_loc, (num_seqs + 1,))
    if block_tables.stride(1) != 1:
        raise ValueError(
            f"block_tables must be contiguous in its last dim, got strides {list(block_tables.stride())}"
        )
    if max_seq_len is not None and max_seq_len > block_tables.shape[1] * block_size:
        raise ValueError(
            f"max_seq_len {max_seq_len} exceeds the {block_tables.shape[1]} blocks of {block_size} "
            "slots per sequence that block_tables holds"
        )
    if max_query_len is not None and max_query_len > q.shape[0]:
        raise ValueError(f"max_query_len {max_query_len} exceeds the {q.shape[0]} query rows")
    _check_devices(
        q, k_cache=k_cache, block_tables=block_tables, seq_lens=seq_lens, query_start_loc=query_start_loc
    )

    impl: PagedAttentionImpl = paged_attention_torch
    if chosen == "triton":
        from shared.kernels.triton_paged_attention import paged_attention_triton

        impl = paged_attention_triton
    return impl(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
        max_query_len=max_query_len, max_seq_len=max_seq_len,
    )


def _pick_backend(backend: str | None, x: torch.Tensor) -> str:
    if backend is None:
        return "triton" if x.is_cuda and _HAS_TRITON else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    if backend == "triton" and not _HAS_TRITON:
        raise ValueError("backend='triton' but triton is not installed (pip install 'pdserve[gpu]')")
    return backend


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must be [num_blocks, block_size, Hkv, D], got {_shape(k_cache)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache {_shape(v_cache)} and k_cache {_shape(k_cache)} differ in shape")
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache is {v_cache.dtype} but k_cache is {k_cache.dtype}")
    if v_cache.device != k_cache.device:
        raise ValueError(f"v_cache is on {v_cache.device} but k_cache is on {k_cache.device}")
    _, _, num_kv_heads, head_dim = k_cache.shape
    # Dim 0 may be strided (a block of all layers is contiguous in the engine's big tensor), but each
    # block must be one dense [block_size, Hkv, D] run: both kernels address slots by that layout.
    dense = (num_kv_heads * head_dim, head_dim, 1)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.stride()[1:] != dense:
            raise ValueError(
                f"{name} must be dense within a block (strides [*, {dense[0]}, {dense[1]}, 1]), "
                f"got strides {list(cache.stride())}"
            )


def _check_index(name: str, x: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {_shape(x)}")
    if x.dtype not in _INDEX_DTYPES:
        raise ValueError(f"{name} must be int32 or int64, got {x.dtype}")
    if x.dim() == 1 and x.stride(0) != 1:  # the Triton kernels index these as flat arrays
        raise ValueError(f"{name} must be contiguous, got stride {x.stride(0)}")


def _check_devices(anchor: torch.Tensor, **others: torch.Tensor) -> None:
    for name, x in others.items():
        if x.device != anchor.device:
            raise ValueError(f"{name} is on {x.device} but the queries/keys are on {anchor.device}")


def _shape(x: torch.Tensor) -> list[int]:
    return list(x.shape)
