"""The KV block key of DESIGN.md: a 128-bit chained digest every process computes the same way.

    key(block i) = blake2b-128(key(block i-1) ‖ token ids of block i as int32 LE ‖ model id)

The chain makes a key name the whole prefix up to and including its block, so equal keys mean
equal KV. The personalization string is the fixed seed; changing it invalidates every cache.
Only full blocks get keys: the last partial block of a sequence is never shared.
"""

from __future__ import annotations

import hashlib
import sys
from array import array

BlockKey = bytes  # 16 bytes

_SEED = b"pdserve-kv-v1"  # ≤ 16 bytes: blake2b personalization
ROOT_KEY: BlockKey = bytes(16)  # the parent of the first block


def block_key(parent: BlockKey, token_ids: list[int] | tuple[int, ...], model_id: str) -> BlockKey:
    tokens = array("i", token_ids)  # C int: 32-bit on every platform we run
    if sys.byteorder == "big":
        tokens.byteswap()  # the key is defined over little-endian int32
    h = hashlib.blake2b(digest_size=16, person=_SEED)
    h.update(parent)
    h.update(tokens.tobytes())
    h.update(model_id.encode())
    return h.digest()


def block_keys(token_ids: list[int], block_size: int, model_id: str, start: int = 0,
               parent: BlockKey = ROOT_KEY) -> list[BlockKey]:
    """Keys of the full blocks of `token_ids`, from block index `start` on (chained from `parent`)."""
    keys = []
    for i in range(start, len(token_ids) // block_size):
        parent = block_key(parent, token_ids[i * block_size:(i + 1) * block_size], model_id)
        keys.append(parent)
    return keys
