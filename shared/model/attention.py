"""What one forward pass needs to read and write the paged KV cache.

A batch is a flat run of T tokens from B sequences. Sequence b contributes the tokens
`query_start_loc[b] : query_start_loc[b+1]` (a prefill chunk, or one decode token); its context,
cached tokens plus these new ones, is `seq_lens[b]` tokens long and lives in the blocks listed by
`block_tables[b]`:

    seq b, block_size 4, seq_len 10, q_len 3          block_tables[b] = [7, 2, 5]
    positions   0 1 2 3 | 4 5 6 7 | 8 9               slot = block * 4 + offset
    blocks         7    |    2    |  5                new tokens 7,8,9 → slots 11, 20, 21
                                 new: ^ ^ ^
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot each new token's K/V is written to
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    seq_lens: torch.Tensor  # [B] int32: context length including the new tokens
    query_start_loc: torch.Tensor  # [B + 1] int32: cumulative new-token offsets
    max_query_len: int
    max_seq_len: int

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]
