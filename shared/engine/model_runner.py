"""Run one forward pass over a batch that mixes prefill chunks and decode tokens.

The scheduler hands over small `ScheduledChunk`s (what to run for each sequence); the runner turns
them into flat tensors plus `AttentionMetadata`, runs the model, and returns logits only for the
rows whose next token is wanted (a prefill chunk that is not the prompt's last needs none).

Where the model has a fused decode step (`fused_decode.py`, the CPU default), chunks of one token
run through it and longer chunks through the model's forward; the two halves of a mixed batch
touch different sequences, so their order does not matter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.kvcache.kv_cache import KVCache
from shared.model.attention import AttentionMetadata
from shared.model.fused_decode import FusedDecoder
from shared.model.llama import LlamaModel


@dataclass
class ScheduledChunk:
    token_ids: list[int]  # the new tokens of this sequence in this step (≥ 1)
    start_pos: int  # absolute position of token_ids[0] = number of tokens already in the cache
    block_table: list[int]  # the sequence's blocks, covering at least start_pos + len(token_ids) tokens
    need_logits: bool = True  # sample after this chunk? (false for a non-final prefill chunk)


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_cache: KVCache, fused: bool = True):
        self.model, self.kv_cache = model, kv_cache
        self.block_size = kv_cache.block_size
        self.device = kv_cache.data.device
        self.fused = FusedDecoder.for_model(model) if fused and self.device.type == "cpu" else None

    def prepare(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        query_start = [0]
        logit_rows: list[int] = []
        max_blocks = max(len(c.block_table) for c in chunks)
        for c in chunks:
            n = len(c.token_ids)
            end = c.start_pos + n
            if n == 0 or len(c.block_table) * bs < end:
                raise ValueError(f"chunk of {n} tokens ending at {end} does not fit {len(c.block_table)} blocks")
            input_ids.extend(c.token_ids)
            pos = range(c.start_pos, end)
            positions.extend(pos)
            slots.extend(c.block_table[p // bs] * bs + p % bs for p in pos)
            seq_lens.append(end)
            query_start.append(query_start[-1] + n)
            if c.need_logits:
                logit_rows.append(query_start[-1] - 1)
        tables = [c.block_table + [0] * (max_blocks - len(c.block_table)) for c in chunks]
        dev = self.device
        attn = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
            max_query_len=max(len(c.token_ids) for c in chunks),
            max_seq_len=max(seq_lens),
        )
        ids = torch.tensor(input_ids, dtype=torch.int64, device=dev)
        pos_t = torch.tensor(positions, dtype=torch.int64, device=dev)
        return ids, pos_t, attn, logit_rows

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """One step; returns fp32 logits [number of chunks with need_logits, V], in chunk order."""
        if self.fused is None:
            return self._forward(chunks)
        single = [i for i, c in enumerate(chunks) if len(c.token_ids) == 1]
        if len(single) == len(chunks):
            return self._fused(chunks)[[i for i, c in enumerate(chunks) if c.need_logits]]
        if not single:
            return self._forward(chunks)
        multi = [i for i, c in enumerate(chunks) if len(c.token_ids) > 1]
        parts = {i: row for i, row in zip(single, self._fused([chunks[i] for i in single]))}
        wanted = [i for i in multi if chunks[i].need_logits]
        parts |= dict(zip(wanted, self._forward([chunks[i] for i in multi])))
        rows = [parts[i] for i, c in enumerate(chunks) if c.need_logits]
        return torch.stack(rows) if rows else torch.empty((0, self.model.config.vocab_size))

    def _forward(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        ids, positions, attn, logit_rows = self.prepare(chunks)
        hidden = self.model(ids, positions, attn, self.kv_cache.layers)
        if not logit_rows:
            return hidden.new_empty((0, self.model.config.vocab_size), dtype=torch.float32)
        return self.model.compute_logits(hidden[logit_rows])

    def _fused(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Chunks of one token each through the fused decode step → logits [len(chunks), V]."""
        bs = self.block_size
        width = max(len(c.block_table) for c in chunks)
        for c in chunks:
            if len(c.block_table) * bs <= c.start_pos:
                raise ValueError(f"chunk at position {c.start_pos} does not fit {len(c.block_table)} blocks")
        ids = torch.tensor([c.token_ids[0] for c in chunks], dtype=torch.int64)
        positions = torch.tensor([c.start_pos for c in chunks], dtype=torch.int64)
        slots = torch.tensor([c.block_table[c.start_pos // bs] * bs + c.start_pos % bs for c in chunks],
                             dtype=torch.int64)
        tables = torch.tensor([c.block_table + [0] * (width - len(c.block_table)) for c in chunks], dtype=torch.int32)
        return self.fused.step(ids, positions, slots, tables, (positions + 1).to(torch.int32), self.kv_cache.data)
