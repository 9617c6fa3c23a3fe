"""Tracing for real: a pdserve stack exports over OTLP/HTTP to a receiver of the test's own, and one
request yields one trace across the gateway, prefill and decode processes."""

from __future__ import annotations

import argparse
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from shared.telemetry import tracing

MODEL = "SmolLM2-135M-Instruct"


class OTLPReceiver:
    """POST /v1/traces with an ExportTraceServiceRequest (protobuf) → its spans, kept."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                               ExportTraceServiceResponse)
        self.spans: list[dict] = []
        lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = self.rfile.read(int(self.headers["Content-Length"]))
                req = ExportTraceServiceRequest.FromString(body)
                with lock:
                    for rs in req.resource_spans:
                        service = next(a.value.string_value for a in rs.resource.attributes
                                       if a.key == "service.name")
                        for ss in rs.scope_spans:
                            for s in ss.spans:
                                receiver.spans.append({
                                    "service": service, "name": s.name, "trace_id": s.trace_id.hex(),
                                    "span_id": s.span_id.hex(), "parent": s.parent_span_id.hex(),
                                    "start": s.start_time_unix_nano / 1e9, "end": s.end_time_unix_nano / 1e9,
                                    "attrs": {a.key: _value(a.value) for a in s.attributes},
                                    "events": [e.name for e in s.events], "status": s.status.code})
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def trace(self, trace_id: str) -> list[dict]:
        return [s for s in self.spans if s["trace_id"] == trace_id]


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def test_tracing_off_injects_nothing():
    span = tracing.tracer.start_span("x")
    assert not span.is_recording() and tracing.headers_for(span) is None
    assert tracing.setup("gateway", "g", None) is False


@pytest.mark.slow
def test_one_trace_across_every_service_over_otlp(tmp_path_factory):
    from services.up import add_up_args, start_stack, wait_healthy
    from shared.transport.servers import free_port

    receiver = OTLPReceiver()
    parser = argparse.ArgumentParser()
    add_up_args(parser)
    args = parser.parse_args(["--port", str(free_port()), "--workdir", str(tmp_path_factory.mktemp("traced")),
                              "--otlp-endpoint", receiver.url])
    stack, url = start_stack(args)
    try:
        wait_healthy(stack, url, timeout=120)
        trace_id, client_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about Paris."}],
                "max_tokens": 64, "ignore_eos": True, "temperature": 0}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120,
                       headers={"traceparent": f"00-{trace_id}-{client_span}-01"})
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 30
        want = {"pdserve-gateway", "pdserve-prefill", "pdserve-decode"}
        while {s["service"] for s in receiver.trace(trace_id)} != want or \
                not any(s["name"] == "decode" for s in receiver.trace(trace_id)):
            assert time.monotonic() < deadline, f"spans so far: {[(s['service'], s['name']) for s in receiver.spans]}"
            time.sleep(0.2)
        time.sleep(1.5)  # the last batches
        spans = receiver.trace(trace_id)
        by_name = {s["name"]: s for s in spans}
        [root] = [s for s in spans if s["parent"] == client_span]  # the client's span is the trace's parent
        assert root["service"] == "pdserve-gateway"
        request = by_name["chat SmolLM2-135M-Instruct"]  # root itself, or inside the HTTP server's spans
        by_id = {s["span_id"]: s for s in spans}
        chain = [request]
        while chain[-1] is not root:
            chain.append(by_id[chain[-1]["parent"]])
        assert all(s["service"] == "pdserve-gateway" for s in chain)
        ids = set(by_id)
        orphans = [(s["service"], s["name"], s["span_id"], s["parent"]) for s in spans if s is not root and s["parent"] not in ids]
        assert not orphans, (orphans, [(s["name"], s["span_id"], s["parent"]) for s in spans])
        assert by_name["prefill"]["parent"] == request["span_id"]
        assert by_name["decode"]["parent"] == by_name["prefill"]["span_id"]  # the DecodeJob carried it
        for name in ("gateway.prepare", "prefill.queue", "kv.lookup", "prefill.compute", "kv.write", "decode.queue",
                     "kv.read", "decode.compute"):
            assert name in by_name, name
        attrs = request["attrs"]
        assert attrs["gen_ai.request.model"] == MODEL and attrs["gen_ai.operation.name"] == "chat"
        assert attrs["gen_ai.usage.output_tokens"] == 64 and attrs["gen_ai.usage.input_tokens"] > 0
        assert attrs["gen_ai.request.max_tokens"] == 64 and attrs["gen_ai.response.finish_reasons"] == ["length"]
        assert attrs["pdserve.prefill_seconds"] > 0 and attrs["pdserve.decode_seconds"] > 0
        assert "gen_ai.first_token" in request["events"]
        assert by_name["decode"]["attrs"]["pdserve.worker"] == "decode-0"
        phases = sum(by_name[n]["end"] - by_name[n]["start"] for n in (
            "gateway.prepare", "prefill.queue", "kv.lookup", "prefill.compute", "kv.write", "decode.queue",
            "kv.read", "decode.compute"))
        total = request["end"] - request["start"]
        print(f"request {total * 1e3:.1f} ms, phases add up to {phases * 1e3:.1f} ms: "
              + ", ".join(f"{s['name']} {1e3 * (s['end'] - s['start']):.1f}" for s in sorted(spans, key=lambda s: s['start'])))
        assert phases == pytest.approx(total, rel=0.05)
    finally:
        stack.stop()
