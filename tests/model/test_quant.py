"""Projections over the checkpoint's own weight blocks (Q4_1, Q8_0, F32) on the CPU kernel."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch

from shared.kernels import cpu_ext
from shared.model.quant import F32, Q4_1, Q8_0, QuantLinear, QuantTensor

gguf_quants = pytest.importorskip("gguf.quants")
from gguf.constants import GGMLQuantizationType  # noqa: E402

needs_ext = pytest.mark.skipif(cpu_ext.load() is None, reason="the CPU extension needs AVX2 (or AVX-512)")


def file_blocks(w: np.ndarray, ggml_type: int) -> QuantTensor:
    """w quantized the way llama.cpp writes a GGUF, then laid out for the kernel."""
    raw = gguf_quants.quantize(w, GGMLQuantizationType(ggml_type))
    return QuantTensor.from_file_blocks(raw, ggml_type, *w.shape)


def weights(n: int, k: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.1


@pytest.mark.parametrize("ggml_type", [Q4_1, Q8_0])
@pytest.mark.parametrize("k", [64, 96, 576])  # 96: an odd number of blocks (padded), 576: quads + a pair
def test_dequantize_is_the_files_values(ggml_type, k):
    w = weights(40, k)
    raw = gguf_quants.quantize(w, GGMLQuantizationType(ggml_type))
    ours = QuantTensor.from_file_blocks(raw, ggml_type, *w.shape).dequantize()
    np.testing.assert_array_equal(ours.numpy(), gguf_quants.dequantize(raw, GGMLQuantizationType(ggml_type)))


@needs_ext
@pytest.mark.parametrize("ggml_type", [Q4_1, Q8_0, F32])
@pytest.mark.parametrize("k", [64, 96, 576, 1536])
def test_matmul_matches_the_dequantized_weights(ggml_type, k):
    w = weights(70, k, seed=k)
    t = QuantTensor.dense(torch.from_numpy(w)) if ggml_type == F32 else file_blocks(w, ggml_type)
    layer = QuantLinear(t)
    x = torch.randn(9, k)
    ref = (x.double() @ t.dequantize().double().T).float()
    out = layer(x)
    # activations carried as two int8 digits: ~16 bits per block of 32, i.e. far inside bf16's error
    err = (out - ref).abs().max() / ref.abs().max()
    assert err < (1e-6 if ggml_type == F32 else 2e-4), err
    bf16 = (x.bfloat16().double() @ t.dequantize().bfloat16().double().T).float()
    assert (out - ref).abs().mean() < (bf16 - ref).abs().mean() / 10


@needs_ext
@pytest.mark.parametrize("ggml_type", [Q4_1, Q8_0, F32])
def test_rows_are_computed_alike_in_any_batch(ggml_type):
    """Batch invariance: a row's output is bit for bit the same alone, in a batch of any size, at any
    position of it (tiles of 4 rows, the rest one at a time; Q4_1 batches of 16+ rows on AMX where
    the machine has it, single rows never)."""
    w = weights(40, 576, seed=3)
    t = QuantTensor.dense(torch.from_numpy(w)) if ggml_type == F32 else file_blocks(w, ggml_type)
    layer = QuantLinear(t)
    x = torch.randn(37, 576)
    whole = layer(x)
    for i in range(37):
        assert torch.equal(layer(x[i:i + 1])[0], whole[i])
    assert torch.equal(layer(x[3:10]), whole[3:10])
    assert torch.equal(layer(x[5:26]), whole[5:26])


@needs_ext
@pytest.mark.parametrize("ggml_type", [Q4_1, Q8_0, F32])
@pytest.mark.parametrize("k", [64, 96, 576])
def test_the_layer_keeps_one_copy_and_reads_the_files_values_back_from_it(ggml_type, k):
    """A layer holds only the kernel's copy of its matrix: the rows it was made from are freed
    (F32 excepted: they are the kernel's copy), and its dense weight and its lookups (the embedding)
    give the file's values back from that copy, bit for bit: 70 rows (a last group of 2 columns)
    and block counts of 2, 3 (padded) and 18."""
    w = weights(70, k, seed=k + 1)
    t = QuantTensor.dense(torch.from_numpy(w)) if ggml_type == F32 else file_blocks(w, ggml_type)
    expected = t.dequantize()
    rows = weakref.ref(t.data)
    layer = QuantLinear(t)
    del t
    gc.collect()
    assert (rows() is None) == (ggml_type != F32)
    assert torch.equal(layer.weight, expected)
    ids = torch.tensor([69, 0, 5, 69, 33, 66])
    assert torch.equal(layer.lookup(ids), expected[ids])


needs_amx = pytest.mark.skipif(cpu_ext.load() is None or not cpu_ext.load().amx_available(),
                               reason="this CPU (or its OS) does not offer AMX")


@needs_amx
@pytest.mark.parametrize("ggml_type", [Q4_1, Q8_0])
@pytest.mark.parametrize("k", [64, 96, 576, 1536])
def test_amx_gives_the_vnni_numbers_bit_for_bit(ggml_type, k):
    """On the tile unit (AMX) each block is summed exactly and scaled in the same order as the VNNI
    tiles do, so turning AMX off changes no bit, for any row count and column range."""
    ext = cpu_ext.load()
    w = weights(200, k, seed=k)  # 200 columns: 12 groups of 16 and a partial one
    layer = QuantLinear(file_blocks(w, ggml_type))
    try:
        for m in (16, 17, 40, 64, 130):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3
            ext.set_amx(True)
            on = layer(x)
            ext.set_amx(False)
            off = layer(x)
            assert torch.equal(on, off), (m, (on - off).abs().max())
    finally:
        ext.set_amx(True)


@needs_ext
@pytest.mark.parametrize("ggml_type", [Q4_1, Q8_0])
def test_lookup_returns_dequantized_rows(ggml_type):
    t = file_blocks(weights(50, 128, seed=5), ggml_type)
    layer = QuantLinear(t)
    ids = torch.tensor([0, 7, 49, 7])
    assert torch.equal(layer.lookup(ids), t.dequantize()[ids])


def test_zero_rows_and_bad_shapes():
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantTensor(torch.zeros(4, 48), F32, 4, 48)
    with pytest.raises(ValueError, match="needs"):
        QuantTensor(torch.zeros(10, dtype=torch.uint8), Q4_1, 4, 64)


def test_mixed_types_concatenate_dense():
    w = weights(8, 64)
    a, b = file_blocks(w, Q4_1), file_blocks(w, Q8_0)
    both = QuantTensor.cat([a, b])
    assert both.type == F32 and both.shape == (16, 64)
    assert torch.equal(both.dequantize()[:8], a.dequantize())
    same = QuantTensor.cat([a, a])
    assert same.type == Q4_1 and torch.equal(same.dequantize()[8:], a.dequantize())
