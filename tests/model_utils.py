"""Helpers shared by tests: a tiny random Llama, and a plain contiguous-cache reference forward."""

from __future__ import annotations

import torch

from shared.model.config import ModelConfig
from shared.model.llama import LlamaModel


def tiny_config(**overrides) -> ModelConfig:
    cfg = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
               head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5, max_model_len=256, name="tiny")
    cfg.update(overrides)
    return ModelConfig(**cfg)


def blocks_model(model: LlamaModel, ggml_type: int) -> LlamaModel:
    """`model` with every projection, the embedding and the (tied) head as checkpoint blocks of
    `ggml_type` (Q4_1 / Q8_0 quantized the way llama.cpp writes them, or F32), on the CPU kernel."""
    import numpy as np
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import quantize

    from shared.model.quant import F32, QuantLinear, QuantTensor

    def blocks(w: torch.Tensor) -> QuantTensor:
        if ggml_type == F32:
            return QuantTensor.dense(w)
        a = w.detach().float().numpy().astype(np.float32)
        return QuantTensor.from_file_blocks(quantize(a, GGMLQuantizationType(ggml_type)), ggml_type, *a.shape)

    for layer in model.layers:
        for parent, name in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"),
                             (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")):
            setattr(parent, name, QuantLinear(blocks(getattr(parent, name).weight)))
    model.embed_tokens = QuantLinear(blocks(model.embed_tokens.weight))
    model.lm_head = model.embed_tokens
    return model


def tiny_model(seed: int = 0, **overrides) -> LlamaModel:
    torch.manual_seed(seed)
    model = LlamaModel(tiny_config(**overrides))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)  # large enough that attention patterns are not uniform
    return model.eval()


@torch.inference_mode()
def contiguous_forward(model: LlamaModel, ids: list[int], cache: list[list[torch.Tensor]] | None):
    """Run `ids` after the tokens already in `cache` with a plain contiguous KV cache and explicit
    causal softmax attention. Returns (logits of the last token [V], cache). No paging involved."""
    cfg = model.config
    start = 0 if cache is None else cache[0][0].shape[0]
    cache = cache or [[torch.zeros(0, cfg.num_kv_heads, cfg.head_dim), torch.zeros(0, cfg.num_kv_heads, cfg.head_dim)]
                      for _ in range(cfg.num_layers)]
    T = len(ids)
    pos = torch.arange(start, start + T)
    x = model.embed(torch.tensor(ids))
    group = cfg.num_heads // cfg.num_kv_heads
    for layer, kv in zip(model.layers, cache):
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q, k, v = attn.qkv_proj(h).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q = model.rope(q.view(T, cfg.num_heads, cfg.head_dim), pos)
        k = model.rope(k.view(T, cfg.num_kv_heads, cfg.head_dim), pos)
        kv[0] = torch.cat([kv[0], k.float()])
        kv[1] = torch.cat([kv[1], v.view(T, cfg.num_kv_heads, cfg.head_dim).float()])
        K = kv[0].repeat_interleave(group, dim=1)  # [S, Hq, Dh]
        V = kv[1].repeat_interleave(group, dim=1)
        S = K.shape[0]
        scores = torch.einsum("thd,shd->hts", q.double(), K.double()) * attn.scale
        mask = torch.arange(S)[None, :] > pos[:, None]  # key after the query's position
        scores = scores.masked_fill(mask[None], float("-inf"))
        o = torch.einsum("hts,shd->thd", scores.softmax(-1), V.double()).to(x.dtype)
        x = x + attn.o_proj(o.reshape(T, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    x = model.norm(x)
    return model.compute_logits(x[-1:])[0], cache


def contiguous_greedy(model: LlamaModel, prompt: list[int], max_new: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and the logits that chose each, one sequence alone, no paging."""
    logits, cache = contiguous_forward(model, prompt, None)
    tokens, all_logits = [], []
    for _ in range(max_new):
        all_logits.append(logits)
        tokens.append(int(logits.argmax()))
        logits, cache = contiguous_forward(model, [tokens[-1]], cache)
    return tokens, all_logits
