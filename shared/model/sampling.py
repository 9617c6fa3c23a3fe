"""Sampling parameters and the batched sampler.

Each row's logits are first processed as vLLM does: `logit_bias` is added, then the repetition
penalty (prompt and output tokens: a positive logit divided by it, a negative one multiplied), then
the frequency penalty (minus penalty × count in the output) and the presence penalty (minus penalty
for each token in the output). Log-probabilities are those of the processed logits divided by the
temperature (1 when greedy), before top-k, top-p and min-p. Then: greedy (argmax) when temperature
is 0; otherwise temperature → top-k → top-p → min-p → a draw. A seeded request
draws output token i from a generator seeded with (seed, i), so its tokens are reproducible whatever
it is batched with, and wherever token i is sampled: a prefill worker samples token 0 and a decode
worker the rest, or a migrated request resumes on another worker, and the stream is the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Constraint:
    """Structured output (see `shared.protocol.messages.ConstraintMsg`): kind json | regex | choice | grammar."""

    kind: str
    spec: str = ""
    choices: tuple[str, ...] = ()


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
    presence_penalty: float = 0.0  # [-2, 2]
    frequency_penalty: float = 0.0  # [-2, 2]
    repetition_penalty: float = 1.0  # > 0; 1: off
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> [-100, 100] added to its logit
    min_p: float = 0.0  # drop tokens less likely than min_p × the most likely one
    logprobs: int | None = None  # None: none; n >= 0: the sampled token's and the n most likely
    constraint: Constraint | None = None  # structured output: what the text must match
    # the prompt's tokens' log-probabilities (each given the tokens before it) and the n most likely
    # there: the whole prompt is computed (no prefix cache), every row's logits kept (echo + logprobs)
    prompt_logprobs: int | None = None

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
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if any(not -100.0 <= b <= 100.0 for b in self.logit_bias.values()):
            raise ValueError("logit_bias values must be in [-100, 100]")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether the logits depend on the tokens so far (penalties) or are biased."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
                or bool(self.logit_bias))


MAX_LOGPROBS = 20


@dataclass
class History:
    """What a row's penalties look at: the prompt and the output tokens before the row's token."""

    prompt: list[int]
    output: list[int]


@dataclass
class TokenLogprobs:
    """The sampled token's log-probability and the `n` most likely tokens' (most likely first)."""

    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


def position_generator(seed: int, position: int) -> torch.Generator:
    """The generator for output token `position` of a request seeded with `seed`."""
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + position) & 0x7FFF_FFFF_FFFF_FFFF)
    return g


def sample(logits: torch.Tensor, params: list[SamplingParams], positions: list[int],
           histories: list[History | None] | None = None) -> tuple[list[int], list[TokenLogprobs | None]]:
    """logits: [B, V] fp32, one row per sequence (processed in place); positions: each row's output
    index; histories: each row's tokens so far (needed where its params are penalized)
    → (token ids, log-probabilities where asked for)."""
    penalized = [i for i, p in enumerate(params) if p.penalized]
    if penalized:
        if histories is None or any(histories[i] is None for i in penalized):
            raise ValueError("penalized rows need their histories")
        apply_penalties(logits, [params[i] for i in penalized], [histories[i] for i in penalized], penalized)
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
    tokens = out.tolist()
    return tokens, token_logprobs(logits, params, tokens)


def apply_penalties(logits: torch.Tensor, params: list[SamplingParams], histories: list[History],
                    rows: list[int]) -> None:
    """Bias and penalties of `rows` of logits, in place, all rows at once (see the module doc)."""
    V = logits.shape[-1]
    n = len(rows)
    sub = logits[rows]
    counts = torch.zeros(n, V, dtype=torch.float32)
    seen = torch.zeros(n, V, dtype=torch.bool)
    for j, h in enumerate(histories):
        if h.output:
            counts[j].scatter_add_(0, torch.tensor(h.output, dtype=torch.int64), torch.ones(len(h.output)))
        if h.prompt:
            seen[j, torch.tensor(h.prompt, dtype=torch.int64)] = True
    seen |= counts > 0
    col = lambda values: torch.tensor(values, dtype=torch.float32).unsqueeze(1)  # noqa: E731
    bias_rows = [j for j, p in enumerate(params) if p.logit_bias]
    for j in bias_rows:
        ids = torch.tensor(list(params[j].logit_bias), dtype=torch.int64)
        sub[j].index_add_(0, ids, torch.tensor(list(params[j].logit_bias.values()), dtype=torch.float32))
    rep = col([p.repetition_penalty for p in params])
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub -= col([p.frequency_penalty for p in params]) * counts
    sub -= col([p.presence_penalty for p in params]) * (counts > 0)
    logits[rows] = sub


def token_logprobs(logits: torch.Tensor, params: list[SamplingParams], tokens: list[int]) -> list[TokenLogprobs | None]:
    """Log-probabilities of the processed logits over the temperature (1 when greedy), where asked."""
    out: list[TokenLogprobs | None] = [None] * len(params)
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return out
    temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in (params[i] for i in rows)]).unsqueeze(1)
    lp = torch.log_softmax(logits[rows] / temps, dim=-1)
    k = max(params[i].logprobs for i in rows)
    top = lp.topk(k, dim=-1) if k else None
    chosen = lp.gather(1, torch.tensor([tokens[i] for i in rows]).unsqueeze(1)).squeeze(1).tolist()
    for j, i in enumerate(rows):
        n = params[i].logprobs
        ids = top.indices[j, :n].tolist() if n else []
        vals = top.values[j, :n].tolist() if n else []
        out[i] = TokenLogprobs(chosen[j], ids, vals)
    return out


def prompt_logprobs(logits: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprobs]:
    """logits: [n, V], row j the model's prediction of targets[j] → each target's log-probability
    and the k most likely tokens' (of the raw logits: no penalty or temperature, as vLLM's prompt
    log-probabilities)."""
    if not targets:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(targets).unsqueeze(1)).squeeze(1).tolist()
    if not k:
        return [TokenLogprobs(c, [], []) for c in chosen]
    top = lp.topk(k, dim=-1)
    return [TokenLogprobs(c, ids, vals) for c, ids, vals in zip(chosen, top.indices.tolist(), top.values.tolist())]


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
    probs = row.softmax(-1)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs
