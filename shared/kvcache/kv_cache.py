"""The paged KV cache tensor of one engine.

Layout `[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`: block-major, so one block
of every layer (the unit the kvstore keeps and ships) is a single contiguous run of bytes, and
export/import of a block is one memcpy. Attention sees per-layer views `kv[:, layer, 0|1]`, which
are strided along the block dim; the kernels take strides, so no copy is made.

This block layout (in the cache dtype) is the KV block format of DESIGN.md.
"""

from __future__ import annotations

import math
import mmap
import weakref

import torch

from shared.kvcache import BLOCK_SIZE
from shared.kvcache.pages import WarmAhead
from shared.model.config import ModelConfig


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """A zeroed tensor. On the CPU an anonymous mapping (page-aligned, zero by definition), whose
    pages the OS provides on first touch: the cache takes memory as it fills, not all at start
    (torch.zeros writes every byte: 755 MB resident for 2,048 blocks, 0.2 s, before any request)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).view(dtype).view(shape)


class KVCache:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int = BLOCK_SIZE,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", warm_ahead: int = 0):
        """`warm_ahead`: on the CPU, keep that many blocks past the highest one used faulted in, from
        a background thread (`warm`), so that writing a block never waits for its pages."""
        if num_blocks <= 0:
            raise ValueError(f"KV cache needs at least one block, got {num_blocks}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.data = zeros((num_blocks, cfg.num_layers, 2, block_size, cfg.num_kv_heads, cfg.head_dim), dtype, device)
        # per-layer (k_cache, v_cache) views, each [num_blocks, block_size, Hkv, Dh]
        self.layers = [(self.data[:, layer, 0], self.data[:, layer, 1]) for layer in range(cfg.num_layers)]
        self._warm = None
        if warm_ahead > 0 and self.data.device.type == "cpu":
            self._warm = WarmAhead(self.data.data_ptr(), self.block_bytes, num_blocks, warm_ahead, "kv-cache-warm")
            weakref.finalize(self, self._warm.close)

    def warm(self, high_water: int) -> None:
        """Blocks [0, high_water) have been handed out (`BlockPool(on_grow=…)`): fault in the next
        `warm_ahead` ones."""
        if self._warm is not None:
            self._warm.need(high_water)

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int = BLOCK_SIZE, dtype: torch.dtype = torch.float32) -> int:
        return cfg.kv_values_per_token * block_size * torch.tensor([], dtype=dtype).element_size()

    @property
    def block_bytes(self) -> int:
        """Bytes of one block (all layers, K and V): the kvstore's slot size."""
        return self.data[0].numel() * self.data.element_size()

    def empty_blocks(self, n: int) -> torch.Tensor:
        """An uninitialised [n, L, 2, bs, Hkv, Dh] tensor to receive blocks from elsewhere."""
        return torch.empty((n, *self.data.shape[1:]), dtype=self.data.dtype, device=self.data.device)

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Copy blocks out: [n, L, 2, bs, Hkv, Dh] (contiguous). One index_select: indexing with the
        list and cloning the result copied every byte twice, through a slow gather (48 blocks, 17.7
        MB: 11-18 ms on one core, against 1.8 ms)."""
        return torch.index_select(self.data, 0, self._index(block_ids))

    def write_blocks(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        """Copy whole blocks in (the import half of a KV transfer): on the CPU one memcpy a block
        (48 blocks: 1.7 ms on one core, against 4-8 ms for an indexed assignment), elsewhere one
        index_copy_."""
        blocks = blocks.to(self.data.dtype)
        if self.data.device.type == "cpu":
            for i, block in enumerate(block_ids):
                self.data[block].copy_(blocks[i])
        else:
            self.data.index_copy_(0, self._index(block_ids), blocks.to(self.data.device))

    def _index(self, block_ids: list[int]) -> torch.Tensor:
        return torch.tensor(block_ids, dtype=torch.long, device=self.data.device)
