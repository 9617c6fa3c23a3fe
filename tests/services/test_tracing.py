"""Tracing for real: a pdserve stack exports over OTLP/HTTP to a receiver of the test's own, and one
request yields one trace across the gateway, prefill and decode processes."""

from __future__ import annotations

import argparse
import time

import httpx
import pytest

from shared.telemetry import tracing
from shared.telemetry.otlp_receiver import OTLPReceiver

MODEL = "SmolLM2-135M-Instruct"
# one request's phases, end to end: together they must account for the request's time
PHASES = ("gateway.prepare", "prefill.queue", "kv.lookup", "prefill.compute", "kv.write", "decode.queue", "kv.read",
          "decode.compute", "gateway.respond")


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
        for name in PHASES:
            assert name in by_name, name
        attrs = request["attrs"]
        assert attrs["gen_ai.request.model"] == MODEL and attrs["gen_ai.operation.name"] == "chat"
        assert attrs["gen_ai.usage.output_tokens"] == 64 and attrs["gen_ai.usage.input_tokens"] > 0
        assert attrs["gen_ai.request.max_tokens"] == 64 and attrs["gen_ai.response.finish_reasons"] == ["length"]
        assert attrs["pdserve.prefill_seconds"] > 0 and attrs["pdserve.decode_seconds"] > 0
        assert "gen_ai.first_token" in request["events"]
        assert by_name["decode"]["attrs"]["pdserve.worker"] == "decode-0"
        assert by_name["gateway.respond"]["parent"] == request["span_id"]
        phases = sum(by_name[n]["end"] - by_name[n]["start"] for n in PHASES)
        total = request["end"] - request["start"]
        print(f"request {total * 1e3:.1f} ms, phases add up to {phases * 1e3:.1f} ms: "
              + ", ".join(f"{s['name']} {1e3 * (s['end'] - s['start']):.1f}" for s in sorted(spans, key=lambda s: s['start'])))
        assert phases == pytest.approx(total, rel=0.05)
    finally:
        stack.stop()


@pytest.mark.slow
def test_a_migrated_request_is_one_trace_with_both_attempts(tmp_path_factory):
    """SIGKILL the decode worker streaming a traced request: the gateway resubmits it (attempt 1)
    with the same trace context, so the trace holds the prefill spans of both attempts, the new
    decode worker's span, and the request span counts one migration."""
    import json
    import signal
    import threading

    from tests.services.test_e2e import up

    receiver = OTLPReceiver()
    stack, url = up(tmp_path_factory, "--prefill", "1", "--decode", "2", "--otlp-endpoint", receiver.url)
    try:
        trace_id = "0af7651916cd43dd8448eb211c80319c"
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": 400,
                "ignore_eos": True, "temperature": 0, "stream": True}
        first: dict = {}
        got = threading.Event()
        result: dict = {}

        def stream() -> None:
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120,
                              headers={"traceparent": f"00-{trace_id}-b7ad6b7169203331-01"}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        first.setdefault("id", chunk.get("id"))
                        got.set()
                        result.setdefault("errors", []).extend([chunk["error"]] if "error" in chunk else [])
                result["done"] = True

        t = threading.Thread(target=stream)
        t.start()
        assert got.wait(60)
        rid = first["id"].removeprefix("chatcmpl-")
        deadline = time.monotonic() + 30
        victim = None
        while victim is None and time.monotonic() < deadline:
            for name in ("decode-0", "decode-1"):
                if f"took request {rid}" in (stack.workdir / f"{name}.log").read_text():
                    victim = name
            time.sleep(0.05)
        assert victim is not None
        time.sleep(0.3)
        stack.process(victim).send_signal(signal.SIGKILL)
        t.join(120)
        assert result.get("done") and not result.get("errors"), result
        deadline = time.monotonic() + 30
        while not any(s["name"].startswith("chat ") for s in receiver.trace(trace_id)):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        time.sleep(1.5)
        spans = receiver.trace(trace_id)
        prefills = sorted(s["attrs"]["pdserve.attempt"] for s in spans if s["name"] == "prefill")
        decodes = [s for s in spans if s["name"] == "decode"]
        assert prefills == [0, 1], [(s["service"], s["name"]) for s in spans]
        assert [s["attrs"]["pdserve.attempt"] for s in decodes] == [1]  # the killed worker exported nothing more
        assert decodes[0]["attrs"]["pdserve.worker"] != victim
        [request] = [s for s in spans if s["name"].startswith("chat ")]
        assert request["attrs"]["pdserve.migrations"] == 1 and request["attrs"]["gen_ai.usage.output_tokens"] == 400
    finally:
        stack.stop()
