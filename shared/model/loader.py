"""Read Llama-architecture checkpoints from disk: GGUF files and Hugging Face safetensors directories.

Both readers produce the same thing: a `ModelConfig` and an iterator of `(hf_name, tensor)` in
Hugging Face's naming and layout (`model.layers.0.self_attn.q_proj.weight`, `[out, in]`). A tensor
is an fp32 `torch.Tensor`, or, for a GGUF matrix in a block format pdserve's kernel multiplies
directly (Q4_1, Q8_0), a `QuantTensor` holding the file's blocks untouched (`quant.py`). The model
(`llama.py`) fuses from there, so it never knows which format it came from.

GGUF specifics:
- other quantized tensors (Q6_K, …) are dequantized to fp32 with the `gguf` package;
- llama.cpp's converter permutes the rows of Q and K from HF's "rotate half" rotary layout to its
  interleaved one; we undo that here so the model uses the HF layout for every checkpoint:

      HF rows of one head:    [x0 x1 … x31 | y0 y1 … y31]      (pairs (xi, yi) rotate together)
      GGUF rows of one head:  [x0 y0 x1 y1 … x31 y31]
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from shared.model.config import ModelConfig
from shared.model.gguf_file import GGUFError, GGUFFile
from shared.model.hub import ModelNotFoundError

if TYPE_CHECKING:  # the weights need torch; reading a checkpoint's config (the gateway) does not
    import torch

    from shared.model.quant import QuantTensor

SUPPORTED_ARCHITECTURES = ("llama",)
SUPPORTED_HF_ARCHITECTURES = ("LlamaForCausalLM",)


class ModelLoadError(ValueError):
    """A checkpoint that exists but cannot be loaded (corrupt, truncated, unsupported)."""


@dataclass
class Checkpoint:
    path: Path
    format: str  # "gguf" | "safetensors"
    config: ModelConfig
    gguf: GGUFFile | None = None  # the parsed file, for GGUF checkpoints

    def tensors(self) -> Iterator[tuple[str, torch.Tensor | QuantTensor]]:
        if self.gguf is not None:
            return _gguf_tensors(self.gguf, self.config)
        return _safetensors_tensors(self.path)


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Identify the checkpoint at `path` and read its config (weights are read lazily)."""
    path = Path(path)
    if not path.exists():
        raise ModelNotFoundError(f"model path {str(path)!r} does not exist")
    if path.is_dir():
        return Checkpoint(path, "safetensors", _hf_config(path))
    if path.suffix != ".gguf" and not _has_gguf_magic(path):
        raise ModelLoadError(f"{path}: not a GGUF file (no GGUF magic) and not a model directory")
    gguf = _open_gguf(path)
    return Checkpoint(path, "gguf", _gguf_config(gguf), gguf)


# --------------------------------------------------------------------------------------------- GGUF


def _has_gguf_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _open_gguf(path: Path) -> GGUFFile:
    try:
        return GGUFFile(path)
    except GGUFError as exc:
        raise ModelLoadError(str(exc)) from exc


def _gguf_config(gguf: GGUFFile) -> ModelConfig:
    path, meta = gguf.path, gguf.metadata
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: unsupported architecture {arch!r}; pdserve loads {', '.join(SUPPORTED_ARCHITECTURES)}"
        )

    def need(key: str):
        value = meta.get(f"{arch}.{key}")
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return value

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
    if not vocab:
        raise ModelLoadError(f"{path}: GGUF metadata gives no vocabulary size")
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(meta.get(f"{arch}.rope.dimension_count", hidden // heads)),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        max_model_len=int(need("context_length")),
        tie_word_embeddings="output.weight" not in gguf.tensors,
        name=str(meta.get("general.name", path.stem)),
    )


_GGUF_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_TO_HF = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _gguf_name_to_hf(name: str) -> str | None:
    if name in _GGUF_TO_HF:
        return _GGUF_TO_HF[name]
    parts = name.split(".")  # blk.<i>.<kind>.weight
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_LAYER_TO_HF:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_TO_HF[parts[2]]}.{parts[3]}"
    return None  # e.g. rope_freqs: recomputed from the config


def unpermute_rotary_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Invert llama.cpp's Q/K row permutation (interleaved → rotate-half layout), per head."""
    out_dim = w.shape[0]
    return w.reshape(n_heads, out_dim // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_tensors(gguf: GGUFFile, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor | QuantTensor]]:
    import torch

    from shared.model.quant import Q4_1, Q8_0, QuantTensor

    path = gguf.path
    for name, info in gguf.tensors.items():
        hf_name = _gguf_name_to_hf(name)
        if hf_name is None:
            continue
        if info.ggml_type in (Q4_1, Q8_0) and len(info.shape) == 2:
            rows = gguf.raw(name)  # [out, in/32 * block bytes]: permuting rows never splits a block
            if hf_name.endswith("q_proj.weight"):
                rows = unpermute_rotary_rows(rows, config.num_heads)
            elif hf_name.endswith("k_proj.weight"):
                rows = unpermute_rotary_rows(rows, config.num_kv_heads)
            yield hf_name, QuantTensor.from_file_blocks(rows, info.ggml_type, *info.shape)
            continue
        try:
            w = gguf.dequantize(name)
        except Exception as exc:
            raise ModelLoadError(f"{path}: cannot dequantize {name} (ggml type {info.ggml_type}): {exc}") from exc
        if hf_name.endswith("q_proj.weight"):
            w = unpermute_rotary_rows(w, config.num_heads)
        elif hf_name.endswith("k_proj.weight"):
            w = unpermute_rotary_rows(w, config.num_kv_heads)
        yield hf_name, torch.from_numpy(np.ascontiguousarray(w))


# ------------------------------------------------------------------------------------- safetensors


def _hf_config(path: Path) -> ModelConfig:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(f"{path}: a model directory needs config.json (+ *.safetensors + tokenizer.json)")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{cfg_file}: invalid JSON ({exc})") from exc
    archs = cfg.get("architectures") or [cfg.get("model_type", "?")]
    if not any(a in SUPPORTED_HF_ARCHITECTURES for a in archs) and cfg.get("model_type") != "llama":
        raise ModelLoadError(f"{path}: unsupported architecture {archs}; pdserve loads Llama models")
    if not list(path.glob("*.safetensors")):
        raise ModelLoadError(f"{path}: no *.safetensors weight files")
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    return ModelConfig(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads", heads)),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        max_model_len=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        name=path.name,
    )


def _safetensors_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name).float()
        except Exception as exc:
            raise ModelLoadError(f"{file}: cannot read safetensors ({exc})") from exc
