"""Configuration of one kvstore instance: a validated dataclass, filled by `__main__` (or a test)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from shared.config import ConnectionConfig
from shared.kvcache import BLOCK_SIZE
from shared.protocol import subjects

# A store name is one NATS subject token (pd.kv.<store>.<op>) and part of Valkey keys.
_STORE_NAME = re.compile(r"[A-Za-z0-9_\-]+")


def default_store_name() -> str:
    return f"kv-{subjects.host_token()}-{os.getpid()}"


@dataclass(kw_only=True)
class KVStoreConfig(ConnectionConfig):
    block_bytes: int  # bytes of one KV block (all layers, K and V, block_size tokens)
    layout: str  # e.g. "L30.2.16.H3.D64.bfloat16": workers check it against their model
    num_slots: int = 2048  # pool size in blocks (SmolLM2 bf16: 360 KiB a block → 720 MiB)
    store: str = field(default_factory=default_store_name)
    block_size: int = BLOCK_SIZE  # tokens per block
    shared_memory: bool = True  # False: private memory, network data path only (shm_name "")
    heartbeat_s: float = 1.0  # stats publish, registry refresh, routing-hint sync
    registry_ttl_s: float = 5.0  # a store that stops heartbeating vanishes from the registry
    max_lease_ttl_s: float = 3600.0  # longer requests are refused (a lease must expire eventually)
    read_chunk_headroom: int = 64 * 1024  # bytes kept free under max_payload for the envelope

    def __post_init__(self) -> None:
        if not _STORE_NAME.fullmatch(self.store):
            raise ValueError(f"kvstore config: store name {self.store!r} must match [A-Za-z0-9_-]+ "
                             "(it is a NATS subject token)")
        for name in ("block_bytes", "num_slots", "block_size", "read_chunk_headroom"):
            if getattr(self, name) <= 0:
                raise ValueError(f"kvstore config: {name} must be positive, got {getattr(self, name)}")
        for name in ("heartbeat_s", "registry_ttl_s", "max_lease_ttl_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"kvstore config: {name} must be positive, got {getattr(self, name)}")
        if self.registry_ttl_s <= self.heartbeat_s:
            raise ValueError(f"kvstore config: registry_ttl_s ({self.registry_ttl_s}) must exceed heartbeat_s "
                             f"({self.heartbeat_s}) or the registry entry flickers")
        if not self.layout:
            raise ValueError("kvstore config: layout must be set (workers check it against their model)")

    @property
    def pool_bytes(self) -> int:
        return self.num_slots * self.block_bytes


def layout_for_model(model: str | None, dtype: str = "bfloat16", block_size: int = BLOCK_SIZE) -> tuple[int, str]:
    """(block_bytes, layout) of a checkpoint's KV block; reads the checkpoint's metadata only.

    The layout names the block format of `shared.kvcache.kv_cache.KVCache`:
    [num_layers, 2 (K, V), block_size, num_kv_heads, head_dim] in `dtype`.
    """
    from shared.config import DTYPE_BYTES, dtype_name
    from shared.model.hub import resolve_model_path
    from shared.model.loader import open_checkpoint

    name = dtype_name(dtype)
    cfg = open_checkpoint(resolve_model_path(model)).config
    block_bytes = cfg.kv_values_per_token * block_size * DTYPE_BYTES[name]  # = KVCache.bytes_per_block
    layout = f"L{cfg.num_layers}.2.{block_size}.H{cfg.num_kv_heads}.D{cfg.head_dim}.{name}"
    return block_bytes, layout
