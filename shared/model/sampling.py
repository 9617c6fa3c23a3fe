"""Sampling parameters and the batched sampler.

Greedy when temperature is 0; otherwise temperature → top-k → top-p → a draw. A seeded request
draws output token i from a generator seeded with (seed, i), so its tokens are reproducible whatever
it is batched with, and wherever token i is sampled: a prefill worker samples token 0 and a decode
worker the rest, or a migrated request resumes on another worker, and the stream is the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # stop strings, checked on detokenized text
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0  # EOS / stop ids are not honoured before this many tokens
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def position_generator(seed: int, position: int) -> torch.Generator:
    """The generator for output token `position` of a request seeded with `seed`."""
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + position) & 0x7FFF_FFFF_FFFF_FFFF)
    return g


def sample(logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> list[int]:
    """logits: [B, V] fp32, one row per sequence; positions: each row's output index → token ids."""
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    greedy_rows = [i for i, p in enumerate(params) if p.greedy]
    if greedy_rows:
        out[greedy_rows] = logits[greedy_rows].argmax(dim=-1).cpu()
    for i, p in enumerate(params):  # random rows: each may have its own generator, so one at a time
        if p.greedy:
            continue
        probs = _probs(logits[i], p)
        g = None if p.seed is None else position_generator(p.seed, positions[i])
        out[i] = torch.multinomial(probs, 1, generator=g).item()
    return out.tolist()


def _probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """row: [V] logits → [V] probabilities after temperature, top-k and top-p."""
    row = row / p.temperature
    if p.top_k > 0 and p.top_k < row.shape[-1]:
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(row, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token when the mass before it already reaches top_p (the first token always stays)
        drop = (cum - sorted_logits.softmax(-1)) >= p.top_p
        row = row.scatter(0, order[drop], float("-inf"))
    return row.softmax(-1)
