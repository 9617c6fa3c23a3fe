"""The gateway's span of one request (shared/telemetry/tracing.py has the whole picture).

It continues the client's `traceparent`, carries the OpenTelemetry GenAI attributes (request and
usage) plus pdserve's (cost, cached tokens, KV bytes, migrations), marks the first token with an
event, and hands its context to the jobs it publishes.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from services.gateway.cost import RequestCost
from shared.protocol.messages import SamplingMsg, Timing, Usage
from shared.telemetry import tracing


class RequestTrace:
    def __init__(self, headers: Mapping[str, str], operation: str, model: str, method: str, path: str) -> None:
        self.started = time.time()
        # inside the HTTP server's own span where there is one (FastAPI ≥ 0.16x makes it, from the
        # client's traceparent); else continue the client's trace directly
        current = tracing.current_span()
        context = None if current.get_span_context().is_valid else tracing.context_from(dict(headers))
        self.span = tracing.tracer.start_span(
            f"{operation} {model}", context=context, kind=tracing.SpanKind.INTERNAL if context is None
            else tracing.SpanKind.SERVER,
            attributes={"gen_ai.operation.name": operation, "gen_ai.request.model": model,
                        "gen_ai.provider.name": "pdserve", "http.request.method": method, "url.path": path})
        self._first_token = False
        self._ended = False
        self._final_event_at: float | None = None

    @property
    def recording(self) -> bool:
        return self.span.is_recording()

    def dispatched(self, request_id: str, params: SamplingMsg, prompt_tokens: int, choices: int) -> None:
        """The request is parsed and tokenized; its jobs are about to be published."""
        if not self.recording:
            return
        self.span.set_attributes({
            "gen_ai.response.id": request_id, "gen_ai.request.max_tokens": params.max_tokens,
            "gen_ai.request.temperature": params.temperature, "gen_ai.request.top_p": params.top_p,
            "gen_ai.request.choice.count": choices, "gen_ai.usage.input_tokens": prompt_tokens,
            **({"gen_ai.request.seed": params.seed} if params.seed is not None else {})})
        tracing.span_at("gateway.prepare", self.span, self.started, time.time())

    def headers(self) -> dict[str, str] | None:
        return tracing.headers_for(self.span)

    def first_token(self) -> None:
        if not self._first_token:
            self._first_token = True
            self.span.add_event("gen_ai.first_token")

    def final_event(self) -> None:
        """A choice's last event arrived: what follows until the response ends is `gateway.respond`
        (the last choice's arrival counts)."""
        self._final_event_at = time.time()

    def finish(self, usage: Usage | None = None, finish_reasons: list[str] | None = None,
               timings: list[Timing] | None = None, error: str | None = None, attempts: int = 0) -> None:
        if self._ended:
            return
        self._ended = True
        if self.recording:
            attrs: dict[str, Any] = {"pdserve.migrations": attempts}
            if usage is not None:
                attrs |= {"gen_ai.usage.output_tokens": usage.completion_tokens,
                          "pdserve.cached_tokens": usage.cached_tokens}
            if finish_reasons:
                attrs["gen_ai.response.finish_reasons"] = finish_reasons
            if timings:
                cost = RequestCost.of(timings)
                attrs |= {"pdserve.prefill_seconds": cost.prefill_s, "pdserve.decode_seconds": cost.decode_s,
                          "pdserve.kv_bytes": cost.kv_bytes, "pdserve.kv_transfer_seconds": cost.kv_transfer_s}
            self.span.set_attributes(attrs)
            if self._final_event_at is not None:
                tracing.span_at("gateway.respond", self.span, self._final_event_at, time.time())
        if error is not None:
            tracing.end_error(self.span, error)
        else:
            self.span.end()
