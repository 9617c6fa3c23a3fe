"""The shape of a Llama-architecture model: everything the forward pass needs to know."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int  # D
    intermediate_size: int  # F (SwiGLU width)
    num_layers: int  # L
    num_heads: int  # Hq
    num_kv_heads: int  # Hkv (grouped-query attention: Hq % Hkv == 0)
    head_dim: int  # usually D // Hq
    rope_theta: float
    rms_norm_eps: float
    max_model_len: int  # context length the checkpoint was trained for
    tie_word_embeddings: bool = True
    name: str = "llama"

    def __post_init__(self) -> None:
        positive = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                    "num_kv_heads", "head_dim", "max_model_len")
        for field in positive:
            if getattr(self, field) <= 0:
                raise ValueError(f"model config: {field} must be positive, got {getattr(self, field)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model config: num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"model config: rotary embeddings need an even head_dim, got {self.head_dim}")

    @property
    def kv_values_per_token(self) -> int:
        """K and V values stored per token across all layers (SmolLM2-135M: 11,520)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim
