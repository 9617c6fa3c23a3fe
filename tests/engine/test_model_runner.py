"""Paged, batched forward passes agree with a plain contiguous-cache reference."""

from __future__ import annotations

import pytest
import torch

from shared.engine.model_runner import ModelRunner, ScheduledChunk
from shared.kvcache.kv_cache import KVCache
from shared.model.llama import load_model
from tests.model_utils import contiguous_greedy, tiny_model


def paged_greedy(model, prompts: list[list[int]], max_new: int, chunk: int | None = None, num_blocks: int = 64,
                 forced: list[list[int]] | None = None, kv_dtype: torch.dtype | None = None):
    """Generate for all prompts in one batch: every step runs one forward over all sequences.
    Prompts are fed `chunk` tokens at a time (mixed with other sequences' decode tokens). With
    `forced`, those tokens are fed back instead of the argmax (teacher forcing). The cache holds
    `kv_dtype` (default: the model's)."""
    bs = 16
    kv = KVCache(model.config, num_blocks, bs, dtype=kv_dtype or next(model.parameters()).dtype)
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
                tok = int(logits[row].argmax()) if forced is None else forced[i][len(out[i])]
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
    model = load_model(default_gguf, quantization="none")  # exact fp32: paging and batching alone
    prompts = _prompts(model.config.vocab_size, [3, 16, 45, 100], seed=7)
    got, got_logits = paged_greedy(model, prompts, max_new=8, chunk=32)
    for prompt, tokens, logits in zip(prompts, got, got_logits):
        ref_tokens, ref_logits = contiguous_greedy(model, prompt, 8)
        assert tokens == ref_tokens
        torch.testing.assert_close(torch.stack(logits), torch.stack(ref_logits), atol=2e-3, rtol=1e-3)


@pytest.mark.slow
def test_real_model_default_paged_batch_matches_contiguous(default_gguf):
    """The default CPU configuration (the file's weight blocks, activations as two int8 digits per
    block, the fused decode step): paging, batching, chunking and the fused step change the logits
    by no more than that ~16-bit rounding (a digit may round the other way when an input moves by
    an ulp), and the greedy tokens agree with a plain contiguous-cache evaluation."""
    from shared.model.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(default_gguf)
    model = load_model(default_gguf)
    assert model.uses_blocks
    texts = ["The quick brown fox", "In 1492, Columbus sailed across the Atlantic Ocean and reached the islands of",
             "def fibonacci(n):\n    if n < 2:\n        return n\n    return"]
    prompts = [tok.encode(t) for t in texts]
    refs = [contiguous_greedy(model, p, 6) for p in prompts]
    got, got_logits = paged_greedy(model, prompts, max_new=6, chunk=16)
    for (ref_tokens, ref_logits), tokens, logits in zip(refs, got, got_logits):
        torch.testing.assert_close(torch.stack(logits), torch.stack(ref_logits), atol=3e-2, rtol=1e-3)
        assert tokens == ref_tokens


@pytest.mark.parametrize("ggml_type", [0, 3, 8])  # F32, Q4_1, Q8_0
def test_fused_forward_matches_the_torch_path(ggml_type):
    """The fused C++ forward computes what the model's torch forward computes over the same weight
    blocks, and a sequence's logits — its prefill's and every decode step's — do not depend on the
    batch it is in, bit for bit."""
    from shared.kernels import cpu_ext
    from tests.model_utils import blocks_model

    if cpu_ext.load() is None:
        pytest.skip("the CPU extension needs AVX2 (or AVX-512)")
    model = blocks_model(tiny_model(seed=4), ggml_type)
    prompts = _prompts(model.config.vocab_size, [5, 17, 33, 2])
    kv = KVCache(model.config, 64, 16)
    assert ModelRunner(model, kv).fused is not None and ModelRunner(model, kv, fused=False).fused is None
    refs = [contiguous_greedy(model, p, 8) for p in prompts]
    got, got_logits = paged_greedy(model, prompts, max_new=8, chunk=7)
    atol = 1e-4 if ggml_type == 0 else 1e-2  # int8 digits: a digit may round the other way
    for (ref_tokens, ref_logits), tokens, logits in zip(refs, got, got_logits):
        torch.testing.assert_close(torch.stack(logits), torch.stack(ref_logits), atol=atol, rtol=1e-3)
        assert tokens == ref_tokens
    # alone vs in a batch of four, one-shot vs chunked prefill: the logits are bit for bit the same
    alone = [paged_greedy(model, [p], max_new=8)[1][0] for p in prompts]
    batched = paged_greedy(model, prompts, max_new=8)[1]
    chunked = paged_greedy(model, prompts, max_new=8, chunk=3)[1]
    for a, b, c in zip(alone, batched, chunked):
        assert all(torch.equal(x, y) and torch.equal(x, z) for x, y, z in zip(a, b, c))


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fused_attention_is_the_same_for_a_row_alone_and_rows_together_across_work_items(kv_dtype):
    """The real model's attention shape (head size 64, 3 query heads per kv head; with a bf16 cache,
    bf16 dot products for the scores where the CPU has them) over prompts longer than two
    256-position work items: the logits of a prompt's last row are bit for bit the same when it is
    one of a whole prompt's rows (sharing the items' staged keys and values), when every prompt token
    is fed alone (as decode rows are) and when fed 5 at a time; so are the decode steps after it."""
    from shared.kernels import cpu_ext
    from tests.model_utils import blocks_model

    if cpu_ext.load() is None:
        pytest.skip("the CPU extension needs AVX2 (or AVX-512)")
    model = blocks_model(tiny_model(seed=6, hidden_size=192, num_heads=3, num_kv_heads=1, head_dim=64,
                                    max_model_len=1024), 3)
    prompts = _prompts(model.config.vocab_size, [530, 300], seed=3)
    runs = [paged_greedy(model, prompts, max_new=4, chunk=c, num_blocks=64, kv_dtype=kv_dtype) for c in (None, 1, 5)]
    for tokens, logits in runs[1:]:
        assert tokens == runs[0][0]
        assert all(torch.equal(a, b) for seq_a, seq_b in zip(runs[0][1], logits) for a, b in zip(seq_a, seq_b))
