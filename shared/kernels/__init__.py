"""Attention kernels over the paged KV cache: one signature, a torch and a Triton implementation.

Import from here: `paged_attention` and `write_kv_cache` check their inputs and dispatch (Triton for
CUDA tensors, torch otherwise). Triton itself is imported only when the Triton path first runs.
"""

from shared.kernels.ops import paged_attention, write_kv_cache

__all__ = ["paged_attention", "write_kv_cache"]
