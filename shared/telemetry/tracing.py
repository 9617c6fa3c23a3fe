"""OpenTelemetry tracing: one trace per request, from the HTTP request through every service.

The gateway continues the client's W3C `traceparent` (or starts a trace), and every job it
publishes carries the context in its NATS headers (`traceparent`, lowercase); the prefill worker
continues it and hands it on with the DecodeJob, the decode worker continues that. Phases are spans
on one timeline: gateway prepare → prefill queue → prefix lookup → prefill compute → KV write →
decode queue → KV read → decode → gateway respond (the last event's arrival to the response's end);
the first token is an event; a migrated request's new attempt is
more spans in the same trace, with `pdserve.attempt`.

Off by default. `setup()` with no endpoint installs nothing: the API's tracer is then a no-op, no
context is injected into any message, and nothing is exported. With `--otlp-endpoint URL`, spans go
to URL/v1/traces over OTLP/HTTP (protobuf) in batches, sampled by `--trace-sample-ratio` at the
root (children follow their parent's decision).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)

_PROPAGATOR = TraceContextTextMapPropagator()
tracer = trace.get_tracer("pdserve")  # a proxy: real once setup() installed a provider, else no-op
_provider = None

__all__ = ["Span", "SpanKind", "Status", "StatusCode", "context_from", "current_span", "end_error", "headers_for",
           "setup",
           "shutdown", "span_at", "tracer"]


def setup(service: str, instance: str, endpoint: str | None, sample_ratio: float = 1.0, *,
          exporter=None, schedule_delay_ms: int = 1000) -> bool:
    """Install the tracer provider of this process (`exporter`: a test's own, instead of OTLP).
    Returns whether tracing is on."""
    global _provider
    if not endpoint and exporter is None:
        return False
    if not 0.0 <= sample_ratio <= 1.0:
        raise ValueError(f"trace sample ratio must be in [0, 1], got {sample_ratio}")
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    if exporter is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        exporter = OTLPSpanExporter(endpoint=endpoint.rstrip("/") + "/v1/traces", timeout=5)
    provider = TracerProvider(resource=Resource.create({"service.name": f"pdserve-{service}",
                                                        "service.instance.id": instance}),
                              sampler=ParentBased(TraceIdRatioBased(sample_ratio)))
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=schedule_delay_ms))
    trace.set_tracer_provider(provider)
    _provider = provider
    log.info("tracing on: %s, sampling %.2f", endpoint or type(exporter).__name__, sample_ratio)
    return True


def current_span() -> Span:
    return trace.get_current_span()


def shutdown() -> None:
    """Flush what is buffered (at a service's exit)."""
    if _provider is not None:
        _provider.shutdown()


def context_from(headers: Mapping[str, str] | None) -> Context:
    """The trace context a message or HTTP request carries (empty: a new trace starts)."""
    return _PROPAGATOR.extract(headers or {})


def headers_for(span: Span) -> dict[str, str] | None:
    """NATS headers carrying `span`'s context to the next service (None when it is not sampled or
    tracing is off: nothing travels)."""
    if not span.get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier or None


def span_at(name: str, parent: Span | Context | None, start_s: float, end_s: float, **attributes) -> None:
    """A span for a phase already over, from wall-clock seconds (e.g. a queue wait: published at
    `created_at` by one process, taken at `end_s` by another)."""
    ctx = trace.set_span_in_context(parent) if isinstance(parent, Span) else parent
    span = tracer.start_span(name, context=ctx, start_time=int(start_s * 1e9), attributes=attributes or None)
    span.end(end_time=int(max(end_s, start_s) * 1e9))


def end_error(span: Span, message: str) -> None:
    span.set_status(Status(StatusCode.ERROR, message))
    span.end()
