"""The model's forward pass as one C++ call: every layer, fused (`shared/kernels/cpu/model_forward.cpp`).

Eager PyTorch runs a decode step of this 30-layer model as ~300 small ops, and at batch 1 their
dispatch cost (not the weights they read) set the step time. The fused forward runs the same math —
the checkpoint's weight blocks through the quantized matmul kernel, fp32 activations, the KV cache
read in place through the block tables — in one call on one OpenMP team.

It takes every kind of row: decode tokens and prefill chunks alike. That is what makes greedy
output independent of how a request was served: a token's numbers are computed by the same code in
the same order whether it was a decode step, one row of a one-shot prefill, of a chunked one, of a
prefill after a prefix-cache hit, on a prefill worker or after a migration. Every matmul output and
every attention row has a fixed order of floating-point operations, whatever else is in the call.
"""

from __future__ import annotations

import torch

from shared.kernels import cpu_ext
from shared.model.llama import LlamaModel


class FusedForward:
    def __init__(self, model: LlamaModel):
        ext = cpu_ext.load()
        if ext is None or not model.uses_blocks:
            raise ValueError("the fused forward needs the CPU extension and a model loaded with its weight blocks")
        cfg = model.config
        linears, norms = [], []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears += [attn.qkv_proj.kernel_weight, attn.o_proj.kernel_weight,
                        mlp.gate_up_proj.kernel_weight, mlp.down_proj.kernel_weight]
            norms += [_f32(layer.input_layernorm.weight), _f32(layer.post_attention_layernorm.weight)]
        self._impl = ext.DecodeModel(
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps, linears, norms,
            model.embed_tokens.kernel_weight, model.lm_head.kernel_weight, _f32(model.norm.weight),
            model.rope.cos, model.rope.sin,
        )

    @classmethod
    def for_model(cls, model: LlamaModel) -> FusedForward | None:
        """A fused forward where this model can use one (CPU extension loaded, block weights), else None."""
        if not model.uses_blocks or cpu_ext.load() is None:
            return None
        return cls(model)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, row_seq: torch.Tensor, block_tables: torch.Tensor,
                logit_rows: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """ids, positions: [T] int64, one row per token (a sequence's rows consecutive, in position order);
        row_seq: [T] int32, each row's index into block_tables [S, max_blocks] int32; logit_rows: [R] int64;
        kv: the engine's whole cache [blocks, L, 2, bs, Hkv, Dh]. Writes every row's K/V, returns logits
        [R, V] fp32 for the rows named."""
        return self._impl.forward(ids, positions, row_seq, block_tables, logit_rows, kv)


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.detach().float().contiguous()
