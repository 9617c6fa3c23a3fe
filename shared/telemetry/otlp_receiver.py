"""A minimal OTLP/HTTP trace receiver: POST /v1/traces (protobuf ExportTraceServiceRequest) → the
spans, kept in memory. For the tests and the tracing benchmark; run it alone to print spans as they
come: `python -m shared.telemetry.otlp_receiver [PORT]`, then `pdserve up --otlp-endpoint URL`."""

from __future__ import annotations

import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class OTLPReceiver:
    """POST /v1/traces with an ExportTraceServiceRequest (protobuf) → its spans, kept."""

    def __init__(self, port: int = 0, on_span=None) -> None:
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
                                if on_span is not None:
                                    on_span(receiver.spans[-1])
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def trace(self, trace_id: str) -> list[dict]:
        return [s for s in self.spans if s["trace_id"] == trace_id]


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def main() -> None:
    receiver = OTLPReceiver(int(sys.argv[1]) if len(sys.argv) > 1 else 4318,
                            on_span=lambda s: print(f"{s['trace_id'][:8]} {s['service']:16s} {s['name']:32s} "
                                                    f"{1e3 * (s['end'] - s['start']):9.1f} ms", flush=True))
    print(f"OTLP/HTTP receiver on {receiver.url}/v1/traces", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
