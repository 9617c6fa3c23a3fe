"""Weight-only int8 projections."""

from __future__ import annotations

import torch

from shared.model.quant import Int8Linear, quantize_linears_int8
from tests.model_utils import tiny_model


def test_int8_linear_matches_dequantized_matmul():
    torch.manual_seed(0)
    dense = torch.nn.Linear(64, 48, bias=False)
    q = Int8Linear(dense.weight)
    assert q.qweight.dtype == torch.int8 and q.scale.shape == (48,)
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16)
    ref = x.float() @ q.weight.float().T
    torch.testing.assert_close(q(x).float(), ref, atol=0.05, rtol=0.02)
    # the error against the original weights: within half a quantization step of the stored scale
    err = (q.weight - dense.weight).abs()
    step = q.scale.float()[:, None]
    assert (err <= step / 2 * (1 + 1e-5)).all()
    assert err.mean() < step.mean() / 3


def test_quantize_replaces_every_projection():
    model = tiny_model()
    n = quantize_linears_int8(model)
    assert n == 4 * model.config.num_layers
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())


def test_large_batches_use_the_dense_matrix():
    torch.manual_seed(1)
    dense = torch.nn.Linear(64, 48, bias=False)
    q = Int8Linear(dense.weight)
    few = torch.randn(Int8Linear.DENSE_FROM_ROWS - 1, 64, dtype=torch.bfloat16)
    many = torch.randn(Int8Linear.DENSE_FROM_ROWS, 64, dtype=torch.bfloat16)
    torch.testing.assert_close(q(many), torch.nn.functional.linear(many, dense.weight.bfloat16()))
    torch.testing.assert_close(q(few), torch._weight_int8pack_mm(few, q.qweight, q.scale))
