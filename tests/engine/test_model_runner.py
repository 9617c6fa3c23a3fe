"""Paged, batched forward passes agree with a plain contiguous-cache reference."""

from __future__ import annotations

import pytest
import torch

from shared.engine.model_runner import ModelRunner, ScheduledChunk
from shared.kvcache.kv_cache import KVCache
from shared.model.llama import load_model
from tests.model_utils import contiguous_greedy, tiny_model


def paged_greedy(model, prompts: list[list[int]], max_new: int, chunk: int | None = None, num_blocks: int = 64):
    """Generate for all prompts in one batch: every step runs one forward over all sequences.
    Prompts are fed `chunk` tokens at a time (mixed with other sequences' decode tokens)."""
    bs = 16
    kv = KVCache(model.config, num_blocks, bs, dtype=next(model.parameters()).dtype)
    runner = ModelRunner(model, kv)
    # scatter blocks: sequence i gets every len(prompts)-th block, in reverse, so nothing is contiguous
    free = list(range(num_blocks))[::-1]
    tables = [[] for _ in prompts]
    computed = [0] * len(prompts)
    tokens = [list(p) for p in prompts]
    out = [[] for _ in prompts]
    logits_seen = [[] for _ in prompts]
    while any(len(o) < max_new for o in out):
        chunks, owners = [], []
        for i, toks in enumerate(tokens):
            if len(out[i]) >= max_new:
                continue
            n = len(toks) - computed[i]
            if chunk is not None:
                n = min(n, chunk)
            end = computed[i] + n
            while len(tables[i]) * bs < end:
                tables[i].append(free.pop())
            need = end == len(toks)
            chunks.append(ScheduledChunk(toks[computed[i]:end], computed[i], tables[i], need))
            owners.append((i, n, need))
        logits = runner.execute(chunks)
        row = 0
        for i, n, need in owners:
            computed[i] += n
            if need:
                logits_seen[i].append(logits[row])
                tok = int(logits[row].argmax())
                row += 1
                out[i].append(tok)
                tokens[i].append(tok)
    return out, logits_seen


def _prompts(vocab: int, lengths: list[int], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("chunk", [None, 7])
def test_tiny_paged_batch_matches_contiguous(chunk):
    model = tiny_model()
    prompts = _prompts(model.config.vocab_size, [1, 5, 16, 17, 40])
    got, got_logits = paged_greedy(model, prompts, max_new=12, chunk=chunk)
    for prompt, tokens, logits in zip(prompts, got, got_logits):
        ref_tokens, ref_logits = contiguous_greedy(model, prompt, 12)
        assert tokens == ref_tokens
        torch.testing.assert_close(torch.stack(logits), torch.stack(ref_logits), atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_real_model_paged_batch_matches_contiguous(default_gguf):
    model = load_model(default_gguf)
    prompts = _prompts(model.config.vocab_size, [3, 16, 45, 100], seed=7)
    got, got_logits = paged_greedy(model, prompts, max_new=8, chunk=32)
    for prompt, tokens, logits in zip(prompts, got, got_logits):
        ref_tokens, ref_logits = contiguous_greedy(model, prompt, 8)
        assert tokens == ref_tokens
        torch.testing.assert_close(torch.stack(logits), torch.stack(ref_logits), atol=2e-3, rtol=1e-3)


@pytest.mark.slow
def test_real_model_int8_paged_batch_matches_contiguous(default_gguf):
    """The fast CPU configuration (bf16 activations, int8 weights): paging and batching change
    nothing beyond bf16 rounding."""
    model = load_model(default_gguf, dtype=torch.bfloat16, quantization="int8")
    prompts = _prompts(model.config.vocab_size, [5, 37, 70], seed=11)
    got, got_logits = paged_greedy(model, prompts, max_new=6, chunk=32)
    for prompt, tokens, logits in zip(prompts, got, got_logits):
        ref_tokens, ref_logits = contiguous_greedy(model, prompt, 6)
        assert tokens == ref_tokens
        torch.testing.assert_close(torch.stack(logits), torch.stack(ref_logits), atol=0.5, rtol=0.05)  # bf16: ~3 significant digits
