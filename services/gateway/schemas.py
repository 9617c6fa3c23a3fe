"""Request bodies of the OpenAI-compatible endpoints (pydantic, strict types).

Strict: a JSON string where a number belongs is a 400, not silently converted (ints are still fine
where a float belongs). Unknown fields are ignored, because the official client sends extras. Fields
we accept but cannot honour are rejected by `unsupported_param()` with the parameter named, rather
than quietly producing something other than what was asked.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidatorFunctionWrapHandler, field_validator

from services.gateway.errors import APIError, bad_request, unsupported, validation_error
from shared.model.sampling_params import MAX_LOGPROBS

MAX_STOP_STRINGS = 4
MAX_CHOICES = 16  # n and best_of: each choice is a decode stream of its own
_SEED_RANGE = (-(2**63), 2**64 - 1)  # what msgpack and torch.Generator.manual_seed both take


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Strict):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM extension: usage (so far) in every chunk


class GenerationRequest(_Strict):
    """Fields both endpoints share: model, sampling, streaming."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # vLLM extension: -1 or 0 = off
    seed: int | None = Field(None, ge=_SEED_RANGE[0], le=_SEED_RANGE[1])
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM extension
    n: int | None = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool | None = False  # vLLM extension
    min_tokens: int | None = Field(0, ge=0)  # vLLM extension
    skip_special_tokens: bool | None = True  # vLLM extension
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)  # vLLM extension
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> [-100, 100]
    min_p: float | None = Field(None, ge=0.0, le=1.0)  # vLLM extension
    # structured output (services/gateway/structured.py): OpenAI's response_format, vLLM's extensions
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.strip().lstrip("-").isdigit():
                raise ValueError(f"keys must be token ids, got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"values must be in [-100, 100], got {bias} for token {key}")
        return value

    @field_validator("stop", mode="wrap")
    @classmethod
    def _check_stop(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> str | list[str] | None:
        stop = _one_of(value, handler, "a string or a list of strings")
        stops = [stop] if isinstance(stop, str) else (stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences are allowed, got {len(stops)}")
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return stop

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    @property
    def num_logprobs(self) -> int | None:
        """How many top alternatives each output token's log-probabilities carry (None: none asked)."""
        return None

    @property
    def num_choices(self) -> int:
        return self.n or 1

    @property
    def num_candidates(self) -> int:
        """How many completions are generated (best_of ≥ n of them are; the n best are returned)."""
        return self.num_choices

    def unsupported_param(self) -> APIError | None:
        if self.stream_options is not None and not self.stream:
            return bad_request("stream_options is only allowed when stream is true", param="stream_options")
        return None


class CompletionRequest(GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES)

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _check_prompt(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        return _one_of(value, handler, "a string, a list of token ids, or a list holding one of those")

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    def unsupported_param(self) -> APIError | None:
        if self.suffix:
            return unsupported("suffix")
        if self.best_of is not None and self.best_of < self.num_choices:
            return bad_request(f"best_of ({self.best_of}) must be at least n ({self.num_choices})", param="best_of")
        if self.stream and self.num_candidates > self.num_choices:
            return bad_request("best_of greater than n cannot be streamed: the best are known only at the end",
                               param="best_of")
        return super().unsupported_param()

    @property
    def num_candidates(self) -> int:
        return max(self.best_of or 1, self.num_choices)


class ChatCompletionRequest(GenerationRequest):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: Any = None  # checked in services/gateway/tools.py, for errors that name the problem
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: list[Any] | None = None

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def unsupported_param(self) -> APIError | None:
        if self.top_logprobs and not self.logprobs:
            return bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
        if self.functions:
            return unsupported("functions", "(deprecated) is not supported; use 'tools'")
        return super().unsupported_param()

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a completion prompt, or chat messages rendered with the model's template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: Any = None  # rendered with the messages, as a chat request renders them
    add_special_tokens: bool | None = None  # default: yes for a prompt, no for messages (the template has them)
    return_token_strs: bool | None = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


def _one_of(value: Any, handler: ValidatorFunctionWrapHandler, expected: str) -> Any:
    """A union's type error as one sentence, instead of one complaint per branch."""
    try:
        return handler(value)
    except ValidationError as exc:
        if any(e["type"] != "missing" for e in exc.errors()):
            raise ValueError(f"must be {expected}") from None
        raise


def parse(model: type[_Strict], payload: Any) -> Any:
    if not isinstance(payload, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(payload).__name__}")
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        raise validation_error(list(exc.errors())) from None
