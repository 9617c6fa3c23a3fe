"""What a request asks of sampling: its parameters, its output constraint, and what comes back per
token. Torch-free, so the gateway (which validates these) never imports torch; the sampler that
applies them is shared/model/sampling.py."""

from __future__ import annotations

from dataclasses import dataclass, field


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


MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's chat limit; vLLM's default max_logprobs)


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
