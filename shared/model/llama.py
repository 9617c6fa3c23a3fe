"""The Llama architecture over a paged KV cache, in plain torch.

One forward pass takes a flat batch of T tokens (prefill chunks and decode tokens of many sequences
mixed, see attention.py) and returns their hidden states; `compute_logits` projects only the rows
that need sampling. Shapes: T tokens, D hidden, Hq/Hkv heads, Dh head dim, F SwiGLU width.

Projections are fused at load (q|k|v into one matrix, gate|up into another) so a layer is four
matmuls, not seven: on this small model the per-op overhead matters as much as the FLOPs.
"""

from __future__ import annotations

import ctypes
import logging
import re
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from shared.kernels import paged_attention, write_kv_cache
from shared.model.attention import AttentionMetadata
from shared.model.config import ModelConfig
from shared.model.loader import ModelLoadError, open_checkpoint
from shared.model.quant import QuantLinear, QuantTensor

log = logging.getLogger(__name__)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with a precomputed cos/sin table; theta comes from the checkpoint."""

    def __init__(self, head_dim: int, max_positions: int, theta: float):
        super().__init__()
        # computed on the CPU even inside a meta-device context (load_model's): there arange would
        # run as a Python reference op, and importing what that needs costs 2 s (torch._dynamo)
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim))
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64, device="cpu"), inv_freq)  # [P, Dh/2]
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def table(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for these positions, [T, 1, Dh/2] each: looked up once per forward pass."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x: [T, H, Dh]; positions: [T]
        return apply_rotary(x, *self.table(positions, x.dtype))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, H, Dh]; cos, sin: [T, 1, Dh/2]; pairs (i, i + Dh/2) rotate together
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.scale = cfg.head_dim**-0.5

    def forward(self, x, rot: tuple[torch.Tensor, torch.Tensor], attn: AttentionMetadata,
                kv: tuple[torch.Tensor, torch.Tensor]):
        # x: [T, D]
        T = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (Hq + 2 Hkv) Dh]
        # q and k heads rotate in one call: [T, Hq + Hkv, Dh]
        qk = apply_rotary(qkv[:, : self.q_size + self.kv_size].view(T, -1, self.head_dim), *rot)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads:]  # [T, Hq, Dh], [T, Hkv, Dh]
        v = qkv[:, self.q_size + self.kv_size:].view(T, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv
        write_kv_cache(k, v, k_cache, v_cache, attn.slot_mapping)
        o = paged_attention(
            q, k_cache, v_cache, attn.block_tables, attn.seq_lens, attn.query_start_loc, self.scale,
            max_query_len=attn.max_query_len, max_seq_len=attn.max_seq_len,
        )  # [T, Hq, Dh]
        return self.o_proj(o.reshape(T, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, F] each
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, rot, attn, kv):
        x = x + self.self_attn(self.input_layernorm(x), rot, attn, kv)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        # no random init (`_weight`): on the meta device (load_model's) normal_ is a Python reference
        # op too (see RotaryEmbedding)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_model_len, cfg.rope_theta)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        # input_ids, positions: [T] → hidden states [T, D]
        x = self.embed(input_ids)
        rot = self.rope.table(positions, x.dtype)
        for layer, kv in zip(self.layers, kv_caches):
            x = layer(x, rot, attn, kv)
        return self.norm(x)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        # [T] → [T, D]
        if isinstance(self.embed_tokens, QuantLinear):
            return self.embed_tokens.lookup(input_ids)
        return self.embed_tokens(input_ids)

    @property
    def uses_blocks(self) -> bool:
        """True when the projections run on the checkpoint's blocks (the CPU kernel path)."""
        return isinstance(self.layers[0].mlp.down_proj, QuantLinear)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, D] → logits [N, V] in fp32 (sampling wants full precision)
        if self.lm_head is None:  # tied: the embedding matrix is the output projection
            return F.linear(hidden, self.embed_tokens.weight).float()
        return self.lm_head(hidden).float()

    # ------------------------------------------------------------------------------ weight loading

    _LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
    _FUSED = {  # HF name suffix → (our fused projection, which part)
        "self_attn.q_proj.weight": ("self_attn.qkv_proj", 0),
        "self_attn.k_proj.weight": ("self_attn.qkv_proj", 1),
        "self_attn.v_proj.weight": ("self_attn.qkv_proj", 2),
        "mlp.gate_proj.weight": ("mlp.gate_up_proj", 0),
        "mlp.up_proj.weight": ("mlp.gate_up_proj", 1),
    }
    _PROJECTIONS = {"self_attn.qkv_proj": 3, "self_attn.o_proj": 1, "mlp.gate_up_proj": 2, "mlp.down_proj": 1}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantTensor]], blocks: bool = False) -> None:
        """Fill the model from HF-named tensors, fusing q/k/v and gate/up; every weight must be given.

        blocks=False: projections become dense parameters (dequantized, in the model's dtype).
        blocks=True: they become `QuantLinear`s over the checkpoint's own blocks, and the embedding
        is looked up from (and, when tied, the head multiplies by) the file's embedding blocks."""
        cfg = self.config
        parts: dict[str, dict[int, QuantTensor]] = {}  # "layers.3.mlp.gate_up_proj" → {part: matrix}
        dense: dict[str, torch.Tensor] = {}
        for hf_name, tensor in weights:
            m = self._LAYER.fullmatch(hf_name)
            if m and (m.group(2) in self._FUSED or m.group(2).removesuffix(".weight") in self._PROJECTIONS):
                target, part = self._FUSED.get(m.group(2), (m.group(2).removesuffix(".weight"), 0))
                parts.setdefault(f"layers.{m.group(1)}.{target}", {})[part] = _as_quant(tensor)
                continue
            name = hf_name.removeprefix("model.")
            if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and cfg.tie_word_embeddings):
                continue  # recomputed / tied checkpoints sometimes store the head anyway
            if name in ("embed_tokens.weight", "lm_head.weight"):
                parts[name.removesuffix(".weight")] = {0: _as_quant(tensor)}
                continue
            dense[name] = tensor if isinstance(tensor, torch.Tensor) else tensor.dequantize()

        expected = {f"layers.{i}.{proj}" for i in range(cfg.num_layers) for proj in self._PROJECTIONS}
        expected |= {"embed_tokens"} | (set() if cfg.tie_word_embeddings else {"lm_head"})
        missing = sorted(p for p in expected if p not in parts)
        missing += sorted(f"{p} part {i}" for p in expected & parts.keys()
                          for i in range(self._PROJECTIONS.get(p, 1)) if i not in parts[p])
        params = dict(self.named_parameters())
        unknown = sorted((set(parts) - expected) | (set(dense) - set(params)))
        if unknown:
            raise ModelLoadError(f"checkpoint tensor {unknown[0]!r} has no place in the Llama model")
        missing += sorted(n for n in params if "norm" in n and n not in dense)
        if missing:
            raise ModelLoadError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")

        for name, tensor in dense.items():
            self._copy(params[name], name, tensor)
        for name, by_part in parts.items():
            matrix = QuantTensor.cat([by_part[i] for i in sorted(by_part)])
            module = self.get_submodule(name)
            expect = (module.num_embeddings, module.embedding_dim) if name == "embed_tokens" else \
                (module.out_features, module.in_features)
            if matrix.shape != expect:
                raise ModelLoadError(f"checkpoint tensor {name!r} has shape {matrix.shape}, expected {expect}")
            if blocks:
                self.set_submodule(name, QuantLinear(matrix))
            else:
                self._copy(module.weight, name, matrix.dequantize())
        if blocks and self.lm_head is None:  # tied: the head multiplies by the embedding's blocks
            self.lm_head = self.embed_tokens

    @staticmethod
    def _copy(param: nn.Parameter, name: str, tensor: torch.Tensor) -> None:
        if param.shape != tensor.shape:
            raise ModelLoadError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
        with torch.no_grad():
            param.data.copy_(tensor)


def _as_quant(t: torch.Tensor | QuantTensor) -> QuantTensor:
    return t if isinstance(t, QuantTensor) else QuantTensor.dense(t)


QUANTIZATIONS = ("auto", "none")


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               quantization: str | None = "auto") -> LlamaModel:
    """Build a LlamaModel from a GGUF file or HF directory.

    quantization="auto" (CPU, float32 activations): every projection, the embedding and the head
    keep the checkpoint's own blocks (Q4_1, Q8_0; anything else as fp32) and run on pdserve's
    kernel. "none" (or another dtype/device): dense weights in `dtype` — fp32 is then the exact
    evaluation of the file, the reference the fast path is tested against."""
    quantization = quantization or "none"
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; choose {' or '.join(QUANTIZATIONS)}")
    blocks = quantization == "auto" and torch.device(device).type == "cpu" and dtype == torch.float32
    ckpt = open_checkpoint(path)
    with torch.device("meta"):
        model = LlamaModel(ckpt.config)
    # to_empty(), but with torch.empty: empty_like of a meta tensor is a Python reference op (0.5 s)
    model = model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device="cpu"))
    # the rotary table is a non-persistent buffer: the line above left it uninitialised, rebuild it
    model.rope = RotaryEmbedding(ckpt.config.head_dim, ckpt.config.max_model_len, ckpt.config.rope_theta)
    model.load_weights(ckpt.tensors(), blocks=blocks)
    if not blocks:
        model = model.to(device=device, dtype=dtype)
    model.rope.float()  # the table stays fp32; it is cast per use
    model.eval()
    _return_freed_memory()
    log.info("loaded %s (%s, %s) on %s: %s", ckpt.config.name, ckpt.format, path, device,
             "the file's weight blocks, fp32 activations" if blocks else f"dense {dtype}")
    return model


def _return_freed_memory() -> None:
    """Hand the heap memory freed while loading (each matrix's copies on its way to the kernel's
    layout) back to the OS. glibc keeps it otherwise: 68 MB of a worker's resident memory here."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: its allocator decides
        pass
