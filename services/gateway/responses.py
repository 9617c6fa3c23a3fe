"""The JSON shapes of OpenAI's API, built from our steps (choice `index` 0 … n-1).

    chat, streaming:        chat.completion.chunk  delta {"role": "assistant", "content": ""} first,
                            then delta {"content": ...}, then delta {} with finish_reason
    completions, streaming: text_completion        choices[0].text deltas, then finish_reason
    include_usage:          one more chunk with "choices": [] and "usage"
    continuous_usage_stats: "usage" (the tokens so far) in every chunk too (vLLM's extension)
    logprobs:               each choice's "logprobs" holds those of the tokens its text came from
    usage.timing_ms, .cost: where the request's time went and what it computed, moved and cost
                            (services/gateway/cost.py), in the usage chunk and non-streamed bodies
    tools:                  message {"content": text outside calls or null, "tool_calls": [...]},
                            finish_reason "tool_calls"; streamed as delta {"tool_calls": [...]}
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from services.gateway.cost import Price, RequestCost, timing_ms
from services.gateway.logprobs import LogprobFormat
from services.gateway.tools import ToolRequest, split_message
from services.gateway.trace import RequestTrace
from shared.protocol.messages import Timing, Usage


@dataclass
class ResponseMeta:
    kind: str  # "chat" | "completion"
    request_id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))
    logprobs: LogprobFormat | None = None  # where the request asked for them
    echo: str = ""  # completions' echo: the prompt's text, before the first text
    continuous_usage: bool = False
    tools: ToolRequest | None = None  # chat with tools: each choice's text is parsed for tool calls
    price: Price = field(default_factory=Price)
    trace: RequestTrace | None = None  # the request's span: ended when the response is complete

    @property
    def id(self) -> str:
        return f"{'chatcmpl' if self.kind == 'chat' else 'cmpl'}-{self.request_id}"

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat" else "text_completion"

    def envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None, "choices": choices}


def breakdown(meta: ResponseMeta, timings: list[Timing]) -> dict[str, Any]:
    """usage.timing_ms (choice 0's) and usage.cost (every choice's, best_of candidates included)."""
    return {"timing_ms": timing_ms(timings[0]), "cost": RequestCost.of(timings).to_json(meta.price)}


def usage_dict(usage: Usage, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """OpenAI's usage; speculative decoding in OpenAI's predicted-output fields and as pdserve's
    `draft_tokens` / `accepted_tokens`; `extra`: the timing and cost breakdown."""
    return (extra or {}) | {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
            "completion_tokens_details": {"accepted_prediction_tokens": usage.accepted_tokens,
                                          "rejected_prediction_tokens": usage.draft_tokens - usage.accepted_tokens},
            "draft_tokens": usage.draft_tokens, "accepted_tokens": usage.accepted_tokens}


def role_chunk(meta: ResponseMeta, index: int = 0) -> dict[str, Any]:
    return meta.envelope(meta.chunk_object, [{"index": index, "delta": {"role": "assistant", "content": ""},
                                               "logprobs": None, "finish_reason": None}])


def text_chunk(meta: ResponseMeta, text: str, finish_reason: str | None = None,
               stop_reason: str | int | None = None, logprobs: dict[str, Any] | None = None,
               usage: Usage | None = None, index: int = 0) -> dict[str, Any]:
    choice: dict[str, Any]
    if meta.kind == "chat":
        choice = {"index": index, "delta": {"content": text} if text else {}, "logprobs": logprobs,
                  "finish_reason": finish_reason}
    else:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason  # vLLM's extension: the stop string / token id that matched
    chunk = meta.envelope(meta.chunk_object, [choice])
    if usage is not None:
        chunk["usage"] = usage_dict(usage)
    return chunk


def tool_chunk(meta: ResponseMeta, calls: list[dict[str, Any]], logprobs: dict[str, Any] | None = None,
               usage: Usage | None = None, index: int = 0) -> dict[str, Any]:
    chunk = meta.envelope(meta.chunk_object, [{"index": index, "delta": {"tool_calls": calls}, "logprobs": logprobs,
                                               "finish_reason": None}])
    if usage is not None:
        chunk["usage"] = usage_dict(usage)
    return chunk


def finish_reason_of(reason: str, has_calls: bool) -> str:
    """OpenAI's "tool_calls" where a choice that ended by itself called tools."""
    return "tool_calls" if has_calls and reason == "stop" else reason


def usage_chunk(meta: ResponseMeta, usage: Usage, timings: list[Timing]) -> dict[str, Any]:
    chunk = meta.envelope(meta.chunk_object, [])
    chunk["usage"] = usage_dict(usage, breakdown(meta, timings))
    return chunk


@dataclass
class ChoiceResult:
    """One choice of a non-streamed response."""

    text: str
    finish_reason: str
    stop_reason: str | int | None
    usage: Usage
    logprobs: dict[str, Any] | None = None
    timing: Timing = field(default_factory=Timing)


def total_usage(usages: list[Usage]) -> Usage:
    """One request's usage over its choices: the prompt once, every choice's completion tokens."""
    first = usages[0]
    return Usage(prompt_tokens=first.prompt_tokens, completion_tokens=sum(u.completion_tokens for u in usages),
                 cached_tokens=first.cached_tokens, draft_tokens=sum(u.draft_tokens for u in usages),
                 accepted_tokens=sum(u.accepted_tokens for u in usages))


def full_response(meta: ResponseMeta, choices: list[ChoiceResult], usage: Usage, timings: list[Timing]
                  ) -> dict[str, Any]:
    out = []
    for index, c in enumerate(choices):
        if meta.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": c.text}
            calls: list[dict[str, Any]] = []
            if meta.tools is not None:
                message["content"], calls = split_message(meta.tools, c.text)
                message["tool_calls"] = calls
            out.append({"index": index, "message": message, "logprobs": c.logprobs,
                        "finish_reason": finish_reason_of(c.finish_reason, bool(calls)), "stop_reason": c.stop_reason})
        else:
            out.append({"index": index, "text": meta.echo + c.text, "logprobs": c.logprobs,
                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
    body = meta.envelope("chat.completion" if meta.kind == "chat" else "text_completion", out)
    body["usage"] = usage_dict(usage, breakdown(meta, timings))
    return body


def sse(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
