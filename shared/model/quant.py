"""Weight-only int8 linear layers for CPU decode.

Decode is bound by reading weights: on this 2-core EPYC a [49152, 576] projection takes 7 ms in
fp32 (16 GB/s), 2.4 ms in bf16 and 0.37 ms as int8 with bf16 activations (`_weight_int8pack_mm`,
~76 GB/s, the machine's bandwidth). Each output row gets one symmetric scale:

    w[n, :] ≈ scale[n] * q[n, :],   scale[n] = max|w[n, :]| / 127,   q ∈ int8

The checkpoint we ship is already 4-bit (Q4_1), so 8 bits per row lose little on top of that.

The int8 kernel only wins while the matmul is bandwidth-bound. From ~16 rows on (a prefill chunk, a
large decode batch) bf16 is 2-3x faster ([3072x576], 512 rows: 6.1 ms int8, 1.9 ms bf16), so the
layer keeps the dense bf16 matrix too and picks by row count: int8 for decode, bf16 for the rest.
That costs the bf16 copy's memory (2 bytes a parameter), and means a row's rounding depends on how
many rows share the step; fp32 (`--quantization none --dtype float32`) is the exact configuration.
"""

from __future__ import annotations

import torch
from torch import nn


class Int8Linear(nn.Module):
    DENSE_FROM_ROWS = 16  # at and above this many rows, the dense matrix is faster

    def __init__(self, weight: torch.Tensor, act_dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        w = weight.detach().float()  # [N, K]
        # round the scale to the activation dtype first and quantize against that rounded scale,
        # so the error stays within half a step (a bf16 scale is off by up to 2^-8 relative)
        scale = (w.abs().amax(dim=1).clamp(min=1e-8) / 127.0).to(act_dtype)
        self.register_buffer("qweight", torch.round(w / scale.float()[:, None]).clamp(-128, 127).to(torch.int8))
        self.register_buffer("scale", scale)
        self.register_buffer("dense", weight.detach().to(act_dtype).contiguous())
        self.in_features, self.out_features = w.shape[1], w.shape[0]

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized matrix in fp32 (a copy), for tests and code that wants it dense."""
        return self.qweight.float() * self.scale.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., K] → [..., N]
        shape = x.shape
        rows = x.reshape(-1, self.in_features).to(self.scale.dtype)
        if rows.shape[0] >= self.DENSE_FROM_ROWS:
            out = torch.nn.functional.linear(rows, self.dense)
        else:
            out = torch._weight_int8pack_mm(rows, self.qweight, self.scale)
        return out.view(*shape[:-1], self.out_features)


def quantize_linears_int8(model: nn.Module, act_dtype: torch.dtype = torch.bfloat16) -> int:
    """Replace every nn.Linear in `model` with an Int8Linear; returns how many were replaced."""
    n = 0
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear) and child.bias is None:
            setattr(model, name, Int8Linear(child.weight, act_dtype))
            n += 1
        else:
            n += quantize_linears_int8(child, act_dtype)
    return n
