"""Decode steps replayed from captured CUDA graphs, one graph per batch-size bucket (the GPU path's
answer to per-op launch overhead; the CPU path has the fused C++ forward instead).

A decode step of n sequences runs as the graph of the smallest bucket ≥ n. Its inputs live in
static device buffers that every graph reads; a step copies its n rows in and fills the bucket's
other rows with padding: token 0 at position 0, a cache slot of -1 (the KV write skips it), a context
of one token read from block 0 (its output is discarded). So a graph never writes the cache outside
its real rows, and capture itself (all rows padding) writes nothing. The attention kernel reads each
sequence's length on the device, so one graph serves every context length up to the block tables'
width: nothing is recaptured as sequences grow.

Only pure decode steps take this path (one token and one logit row a sequence); prefill chunks,
speculative verification and batches over the largest bucket run eagerly. `capture` turns a
function of the static buffers into a replay: CUDA graphs on a CUDA device; elsewhere (tests on
this machine) the function itself, run on the same buffers, so the bucketing and padding are
tested where no GPU is.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from shared.model.attention import AttentionMetadata

log = logging.getLogger(__name__)

Replay = Callable[[], torch.Tensor]


def buckets_up_to(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8, up to and including max_batch."""
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8))
    return sizes + [max_batch]


def eager_capture(fn: Callable[[], torch.Tensor]) -> Replay:
    return fn


class CudaGraphCapture:
    """Captures each function into a CUDA graph; every graph shares one memory pool (capture the
    largest bucket first, so the smaller ones reuse its memory)."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, fn: Callable[[], torch.Tensor]) -> Replay:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up off the capture: Triton compiles, allocators settle
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay


class DecodeGraphs:
    def __init__(self, model, kv_cache, max_batch: int, max_blocks: int,
                 capture: Callable[[Callable[[], torch.Tensor]], Replay] | None = None):
        self.model, self.kv_cache, self.max_blocks = model, kv_cache, max_blocks
        dev = kv_cache.data.device
        if capture is None:
            capture = CudaGraphCapture() if dev.type == "cuda" else eager_capture
        self.buckets = buckets_up_to(max_batch)
        B = self.buckets[-1]
        i32, i64 = torch.int32, torch.int64
        self.ids = torch.zeros(B, dtype=i64, device=dev)
        self.positions = torch.zeros(B, dtype=i64, device=dev)
        self.slots = torch.full((B,), -1, dtype=i64, device=dev)
        self.tables = torch.zeros(B, max_blocks, dtype=i32, device=dev)
        self.seq_lens = torch.ones(B, dtype=i32, device=dev)
        self.query_start = torch.arange(B + 1, dtype=i32, device=dev)  # one query row a sequence
        t0 = time.perf_counter()
        self.replays = {b: capture(self._step_fn(b)) for b in reversed(self.buckets)}
        self.capture_seconds = time.perf_counter() - t0
        log.info("decode graphs for batch sizes %s captured in %.2f s", self.buckets, self.capture_seconds)

    def _step_fn(self, b: int) -> Callable[[], torch.Tensor]:
        attn = AttentionMetadata(slot_mapping=self.slots[:b], block_tables=self.tables[:b],
                                 seq_lens=self.seq_lens[:b], query_start_loc=self.query_start[:b + 1],
                                 max_query_len=1, max_seq_len=self.max_blocks * self.kv_cache.block_size)

        @torch.inference_mode()
        def step() -> torch.Tensor:
            hidden = self.model(self.ids[:b], self.positions[:b], attn, self.kv_cache.layers)
            return self.model.compute_logits(hidden)

        return step

    def accepts(self, chunks) -> bool:
        """Whether this step is pure decode and fits a bucket."""
        return (len(chunks) <= self.buckets[-1]
                and all(len(c.token_ids) == 1 and c.num_logits == 1 and len(c.block_table) <= self.max_blocks
                        for c in chunks))

    @torch.inference_mode()
    def run(self, chunks) -> torch.Tensor:
        """One decode step of `chunks` (see `accepts`) → fp32 logits [len(chunks), V]."""
        n = len(chunks)
        b = next(size for size in self.buckets if size >= n)
        bs = self.kv_cache.block_size
        width = max(len(c.block_table) for c in chunks)
        pos = [c.start_pos for c in chunks]
        host = {
            self.ids: [c.token_ids[0] for c in chunks] + [0] * (b - n),
            self.positions: pos + [0] * (b - n),
            self.slots: [c.block_table[p // bs] * bs + p % bs for c, p in zip(chunks, pos)] + [-1] * (b - n),
            self.seq_lens: [p + 1 for p in pos] + [1] * (b - n),
        }
        for buf, values in host.items():
            buf[:b].copy_(torch.tensor(values, dtype=buf.dtype), non_blocking=True)
        tables = torch.zeros(b, width, dtype=torch.int32)  # padding rows read block 0
        for i, c in enumerate(chunks):
            tables[i, :len(c.block_table)] = torch.tensor(c.block_table, dtype=torch.int32)
        # columns past `width` keep older values: a row reads only the blocks its length covers
        self.tables[:b, :width].copy_(tables, non_blocking=True)
        return self.replays[b]()[:n].clone()  # the graph's output is overwritten by its next replay
