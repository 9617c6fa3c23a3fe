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

MAX_STOP_STRINGS = 4
_SEED_RANGE = (-(2**63), 2**64 - 1)  # what msgpack and torch.Generator.manual_seed both take


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Strict):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = None  # vLLM extension; accepted, not implemented


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
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool | None = False  # vLLM extension
    min_tokens: int | None = Field(0, ge=0)  # vLLM extension
    skip_special_tokens: bool | None = True  # vLLM extension
    # accepted only at their neutral values
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

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

    def unsupported_param(self) -> APIError | None:
        if self.n is not None and self.n != 1:
            return unsupported("n", f"= {self.n} is not supported: one choice per request (n=1)")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                return unsupported(name, "other than 0 is not supported by this server")
        if self.repetition_penalty not in (None, 1, 1.0):
            return unsupported("repetition_penalty", "other than 1 is not supported by this server")
        if self.logit_bias:
            return unsupported("logit_bias")
        if self.stream_options is not None and not self.stream:
            return bad_request("stream_options is only allowed when stream is true", param="stream_options")
        return None


class CompletionRequest(GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _check_prompt(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        return _one_of(value, handler, "a string, a list of token ids, or a list holding one of those")

    def unsupported_param(self) -> APIError | None:
        if self.echo:
            return unsupported("echo")
        if self.logprobs is not None:
            return unsupported("logprobs")
        if self.suffix:
            return unsupported("suffix")
        if self.best_of not in (None, 1):
            return unsupported("best_of", "other than 1 is not supported by this server")
        return super().unsupported_param()


class ChatCompletionRequest(GenerationRequest):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def unsupported_param(self) -> APIError | None:
        if self.logprobs:
            return unsupported("logprobs")
        if self.top_logprobs is not None:
            return unsupported("top_logprobs")
        if self.tools or self.functions:
            return unsupported("tools" if self.tools else "functions")
        if self.tool_choice not in (None, "none", "auto"):
            return unsupported("tool_choice")
        if self.response_format is not None and self.response_format.get("type") != "text":
            return unsupported("response_format", "other than {'type': 'text'} is not supported by this server")
        return super().unsupported_param()

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def _one_of(value: Any, handler: ValidatorFunctionWrapHandler, expected: str) -> Any:
    """A union's type error as one sentence, instead of one complaint per branch."""
    try:
        return handler(value)
    except ValidationError as exc:
        if any(e["type"] != "missing" for e in exc.errors()):
            raise ValueError(f"must be {expected}") from None
        raise


def parse(model: type[GenerationRequest], payload: Any) -> Any:
    if not isinstance(payload, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(payload).__name__}")
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        raise validation_error(list(exc.errors())) from None
