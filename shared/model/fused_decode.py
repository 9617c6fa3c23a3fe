"""The decode step as one C++ call: every layer of the model, fused (`shared/kernels/cpu/decode_step.cpp`).

Eager PyTorch runs a decode step of this 30-layer model as ~300 small ops, and at batch 1 their
dispatch cost (not the weights they read) set the step time. The fused step runs the same math —
the checkpoint's weight blocks through the same matmul kernel as the torch path, fp32 activations,
the KV cache read in place through the block tables — in one call on one OpenMP team.

It takes rows of one new token each (decode steps, and 1-token chunks); prefill chunks of several
tokens run through `LlamaModel.forward`, where the per-op cost is spread over many rows.
"""

from __future__ import annotations

import torch

from shared.kernels import cpu_ext
from shared.model.llama import LlamaModel


class FusedDecoder:
    def __init__(self, model: LlamaModel):
        ext = cpu_ext.load()
        if ext is None or not model.uses_blocks:
            raise ValueError("the fused decode step needs the CPU extension and a model loaded with its weight blocks")
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
    def for_model(cls, model: LlamaModel) -> FusedDecoder | None:
        """A fused decoder where this model can use one (CPU extension loaded, block weights), else None."""
        if not model.uses_blocks or cpu_ext.load() is None:
            return None
        return cls(model)

    def step(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor,
             seq_lens: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """ids, positions, slots: [B] int64; block_tables [B, max_blocks] int32; seq_lens [B] int32 (= position + 1);
        kv: the engine's whole cache [blocks, L, 2, bs, Hkv, Dh]. Writes each row's K/V, returns logits [B, V] fp32."""
        return self._impl.step(ids, positions, slots, block_tables, seq_lens, kv)


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.detach().float().contiguous()
