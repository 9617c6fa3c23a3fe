"""Attention kernels over the paged KV cache: one signature, a torch and a Triton implementation.

Import from here: `paged_attention` and `write_kv_cache` check their inputs and dispatch (Triton for
CUDA tensors, torch otherwise). Triton itself is imported only when the Triton path first runs, and
torch only when one of them is first imported (`pdserve up` reads `cpu_ext` without it).
"""

__all__ = ["paged_attention", "write_kv_cache"]


def __getattr__(name: str):
    if name in __all__:
        from shared.kernels import ops

        return getattr(ops, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
