"""Projections with the weights exactly as the checkpoint stores them.

A GGUF file keeps most matrices in blocks of 32 values (Q4_1: a 4-bit code, a scale d and a
minimum m per block; Q8_0: an 8-bit code and a scale). pdserve multiplies by those blocks directly
(`shared/kernels/cpu/quant_matmul.h`): integer dot products of the file's codes with the
activations written as two int8 digits (~16 bits, far finer than bf16), scaled by the file's d and
m. The weights are the file's, not a re-quantization of them, and every path — decode rows,
prefill chunks, large batches — computes with the same values in the same order.

    .gguf tensor            QuantTensor.data                         QuantLinear (the kernel's copy)
    [N, K] Q4_1 blocks  ->  uint8 [N, K/32 * 20], codes | scales  ->  y = x @ (q*d + m)^T   (fp32 out)

Types the kernel has no code for (Q6_K, F16, …) and safetensors checkpoints are held dense in fp32
(type F32), which the same kernel multiplies. Without the CPU extension (no AVX2, or CUDA) a
layer falls back to a dense copy of the same fp32 weights and `torch.nn.functional.linear`.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from shared.kernels import cpu_ext

F32, Q4_1, Q8_0 = 0, 3, 8  # ggml type ids
FILE_BLOCK_BYTES = {Q4_1: 20, Q8_0: 34}  # bytes per block of 32 values in a GGUF file
TYPE_NAMES = {F32: "F32", Q4_1: "Q4_1", Q8_0: "Q8_0"}

_Q4_1 = np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", 16)])
_Q8_0 = np.dtype([("d", "<f2"), ("qs", "i1", 32)])


def padded_blocks(k: int) -> int:
    return (k // 32 + 1) // 2 * 2


def kernel_bytes(ggml_type: int, n: int, k: int) -> int:
    """Bytes of an [n, k] matrix in the kernel's row layout (quant_matmul.h)."""
    nb = padded_blocks(k)
    return {F32: n * k * 4, Q4_1: n * nb * 20, Q8_0: n * nb * 34}[ggml_type]


class QuantTensor:
    """A [n, k] matrix as the kernel reads it (`shared/kernels/cpu/quant_matmul.h`): rows of the file's
    blocks with their codes gathered first and their scales after; the values are the file's, bit for
    bit. `data` is uint8 (F32: float32 [n, k])."""

    def __init__(self, data: torch.Tensor, ggml_type: int, n: int, k: int):
        if ggml_type not in TYPE_NAMES:
            raise ValueError(f"no kernel for ggml type {ggml_type}")
        if k % 32:
            raise ValueError(f"in_features must be a multiple of 32, got {k}")
        if data.numel() * data.element_size() != kernel_bytes(ggml_type, n, k):
            raise ValueError(f"{TYPE_NAMES[ggml_type]} [{n}, {k}] needs {kernel_bytes(ggml_type, n, k)} bytes")
        self.data, self.type, self.shape = data.contiguous(), ggml_type, (n, k)

    @classmethod
    def dense(cls, w: torch.Tensor) -> QuantTensor:
        return cls(w.detach().float().contiguous(), F32, *w.shape)

    @classmethod
    def from_file_blocks(cls, raw: np.ndarray, ggml_type: int, n: int, k: int) -> QuantTensor:
        """From GGUF blocks ([n, k/32 * block bytes] uint8): codes of a row first, then its scales.

            file row:    [d m qs] [d m qs] ...          (Q4_1, 20 bytes a block)
            kernel row:  qs qs ... | d d ... | m m ...  (blocks padded to an even count with zeros)
        """
        nb, nbp = k // 32, padded_blocks(k)
        if ggml_type == Q4_1:
            b = np.ascontiguousarray(raw).reshape(n, nb * 20).view(_Q4_1)  # [n, nb]
            qs = np.zeros((n, nbp, 16), np.uint8)
            d, m = np.zeros((n, nbp), np.float16), np.zeros((n, nbp), np.float16)
            qs[:, :nb], d[:, :nb], m[:, :nb] = b["qs"], b["d"], b["m"]
            rows = np.concatenate([qs.reshape(n, -1), d.view(np.uint8), m.view(np.uint8)], axis=1)
        elif ggml_type == Q8_0:
            b = np.ascontiguousarray(raw).reshape(n, nb * 34).view(_Q8_0)
            u = np.full((n, nbp, 32), 128, np.uint8)  # the code + 128: vpdpbusd wants unsigned weights
            d = np.zeros((n, nbp), np.float16)
            u[:, :nb] = (b["qs"].astype(np.int16) + 128).astype(np.uint8)
            d[:, :nb] = b["d"]
            rows = np.concatenate([u.reshape(n, -1), d.view(np.uint8)], axis=1)
        else:
            raise ValueError(f"no kernel layout for ggml type {ggml_type}")
        return cls(torch.from_numpy(np.ascontiguousarray(rows)), ggml_type, n, k)

    @classmethod
    def cat(cls, parts: list[QuantTensor]) -> QuantTensor:
        """Stack rows of several matrices (q|k|v, gate|up); mixed types become dense fp32."""
        if len({(p.type, p.shape[1]) for p in parts}) == 1:
            return cls(torch.cat([p.data for p in parts]), parts[0].type, sum(p.shape[0] for p in parts), parts[0].shape[1])
        return cls.dense(torch.cat([p.dequantize() for p in parts]))

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def dequantize(self) -> torch.Tensor:
        """fp32 [n, k]: the file's values (q*d + m rounded once to fp32), computed in numpy."""
        n, k = self.shape
        if self.type == F32:
            return self.data.clone()
        nb, nbp = k // 32, padded_blocks(k)
        raw = self.data.numpy().reshape(n, -1)
        if self.type == Q4_1:
            qs = raw[:, : nbp * 16].reshape(n, nbp, 16)[:, :nb]
            d = raw[:, nbp * 16: nbp * 18].copy().view(np.float16)[:, :nb, None].astype(np.float32)
            m = raw[:, nbp * 18:].copy().view(np.float16)[:, :nb, None].astype(np.float32)
            q = np.concatenate([qs & 15, qs >> 4], axis=2).astype(np.float32)  # [n, nb, 32]
            w = q * d + m  # q*d is exact in fp32 (4 x 11 bits): one rounding, as the kernel's fma
        else:
            q = raw[:, : nbp * 32].reshape(n, nbp, 32)[:, :nb].astype(np.float32) - 128.0
            d = raw[:, nbp * 32:].copy().view(np.float16)[:, :nb, None].astype(np.float32)
            w = q * d
        return torch.from_numpy(np.ascontiguousarray(w.reshape(n, k), dtype=np.float32))


class QuantLinear(nn.Module):
    """y = x @ W^T with W in checkpoint blocks; x and y fp32.

    The layer keeps one copy of the matrix: the kernel's (the same values, laid out for its tiles),
    or without the extension a dense fp32 one. The rows it was made from are not kept, so a worker
    holds its weights once."""

    def __init__(self, weight: QuantTensor):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.ggml_type = weight.type
        self._ext = cpu_ext.load()
        self._kernel_weight = None if self._ext is None else self._ext.Weight(weight.data, weight.type, *weight.shape)
        # the fallback (no extension): the same fp32 values, dense
        self._dense = weight.dequantize() if self._ext is None else None

    @property
    def nbytes(self) -> int:
        """Bytes of the matrix in the file's blocks (what one pass over it reads, give or take padding)."""
        return kernel_bytes(self.ggml_type, self.out_features, self.in_features)

    @property
    def weight(self) -> torch.Tensor:
        """fp32 [N, K], dequantized (a copy, for tests and code that wants it dense)."""
        if self._ext is None:
            return self._dense.clone()
        return self.lookup(torch.arange(self.out_features))

    @property
    def kernel_weight(self):
        return self._kernel_weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., K] fp32 → [..., N] fp32
        shape = x.shape
        rows = x.reshape(-1, self.in_features)
        if self._ext is None:
            out = torch.nn.functional.linear(rows.to(self._dense.dtype), self._dense)
        else:
            out = self._ext.matmul(rows.float().contiguous(), self._kernel_weight)
        return out.view(*shape[:-1], self.out_features)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` dequantized, [T, K] fp32: the embedding lookup when this matrix is a tied head."""
        if self._ext is None:
            return self._dense[ids]
        return self._ext.embed(ids.long().contiguous(), self._kernel_weight)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {TYPE_NAMES[self.ggml_type]}"
