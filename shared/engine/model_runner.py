"""Run one forward pass over a batch that mixes prefill chunks and decode tokens.

The scheduler hands over small `ScheduledChunk`s (what to run for each sequence); the runner turns
them into flat tensors plus `AttentionMetadata`, runs the model, and returns logits only for the
rows whose next token is wanted (a prefill chunk that is not the prompt's last needs none).

Where the model has a fused forward (`fused_forward.py`, the CPU default), every chunk — decode
tokens and prefill chunks — runs through it, so a token is computed the same way on every path;
otherwise through the model's torch forward. On a CUDA device the pure decode steps replay captured
graphs of that torch forward (`decode_graphs.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.engine.decode_graphs import DecodeGraphs
from shared.kvcache.kv_cache import KVCache
from shared.model.attention import AttentionMetadata
from shared.model.fused_forward import FusedForward
from shared.model.llama import LlamaModel


@dataclass
class ScheduledChunk:
    token_ids: list[int]  # the new tokens of this sequence in this step (≥ 1)
    start_pos: int  # absolute position of token_ids[0] = number of tokens already in the cache
    block_table: list[int]  # the sequence's blocks, covering at least start_pos + len(token_ids) tokens
    # logits for this many of its last rows: 1 to sample the next token, 0 for a non-final prefill
    # chunk, 1 + k to verify k speculative tokens
    num_logits: int = 1


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_cache: KVCache, fused: bool = True, max_batch: int = 64,
                 max_model_len: int | None = None):
        """fused: the compiled step where the device has one (the C++ forward on the CPU, decode graphs
        on CUDA, captured for up to `max_batch` sequences of up to `max_model_len` tokens); False: eager."""
        self.model, self.kv_cache = model, kv_cache
        self.block_size = kv_cache.block_size
        self.device = kv_cache.data.device
        self.fused = FusedForward.for_model(model) if fused and self.device.type == "cpu" else None
        self.graphs = None
        if fused and self.device.type == "cuda":
            max_len = max_model_len or model.config.max_model_len
            self.graphs = DecodeGraphs(model, kv_cache, max_batch, -(-max_len // self.block_size))

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
            logit_rows.extend(range(query_start[-1] - c.num_logits, query_start[-1]))
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
        """One step; returns fp32 logits [sum of num_logits, V], in chunk order."""
        if self.fused is not None:
            return self._fused(chunks)
        if self.graphs is not None and self.graphs.accepts(chunks):
            return self.graphs.run(chunks)
        return self._forward(chunks)

    def _forward(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        ids, positions, attn, logit_rows = self.prepare(chunks)
        hidden = self.model(ids, positions, attn, self.kv_cache.layers)
        if not logit_rows:
            return hidden.new_empty((0, self.model.config.vocab_size), dtype=torch.float32)
        return self.model.compute_logits(hidden[logit_rows])

    def _fused(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Every chunk through the fused forward → logits [sum of num_logits, V]."""
        bs = self.block_size
        width = max(len(c.block_table) for c in chunks)
        ids: list[int] = []
        positions: list[int] = []
        row_seq: list[int] = []
        logit_rows: list[int] = []
        for s, c in enumerate(chunks):
            end = c.start_pos + len(c.token_ids)
            if not c.token_ids or len(c.block_table) * bs < end:
                raise ValueError(f"chunk of {len(c.token_ids)} tokens ending at {end} does not fit {len(c.block_table)} blocks")
            ids += c.token_ids
            positions += range(c.start_pos, end)
            row_seq += [s] * len(c.token_ids)
            logit_rows.extend(range(len(ids) - c.num_logits, len(ids)))
        tables = torch.tensor([c.block_table + [0] * (width - len(c.block_table)) for c in chunks], dtype=torch.int32)
        return self.fused.forward(torch.tensor(ids, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64),
                                  torch.tensor(row_seq, dtype=torch.int32), tables,
                                  torch.tensor(logit_rows, dtype=torch.int64), self.kv_cache.data)
