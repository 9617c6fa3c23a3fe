"""Fault injection on real processes: SIGKILL workers mid-request and check that every request
still ends — completed, or with a clear error event — within a bounded time."""

from __future__ import annotations

import json
import re
import signal
import threading
import time

import httpx
import pytest

from tests.services.test_e2e import MODEL, chat, metric_values, up

pytestmark = pytest.mark.slow

def long_prompt(seed: int) -> str:
    """~2,000 tokens, different from the first block on for each seed (no prefix-cache sharing)."""
    return f"Document {seed}. " + " ".join(f"Line {i}: the fox {seed} jumps over dog {i * seed}." for i in range(170))


def stream_events(url: str, content: str, max_tokens: int, timeout: float = 90) -> tuple[str, list[dict], float]:
    """Stream one chat request; returns (text, error payloads, seconds until the stream ended)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, "ignore_eos": True}
    text, errors = "", []
    t0 = time.monotonic()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                errors.append(chunk["error"])
            for choice in chunk.get("choices", []):
                text += choice["delta"].get("content") or ""
    return text, errors, time.monotonic() - t0


def test_prefill_worker_killed_mid_job_request_completes_once(tmp_path_factory):
    """JetStream redelivers the unacked job to the surviving prefill worker (ack wait 3 s); the
    client gets the same answer as undisturbed, with no duplicated first token."""
    stack, url = up(tmp_path_factory, "--prefill", "2", "--decode", "1", "--worker-arg=--ack-wait=3",
                    "--worker-arg=--max-inflight=1")
    try:
        result = {}
        thread = threading.Thread(target=lambda: result.update(zip(("text", "errors", "secs"),
                                                                    stream_events(url, long_prompt(1), 12))))
        thread.start()
        victim = None
        deadline = time.monotonic() + 30
        while victim is None and time.monotonic() < deadline:  # which prefill worker took the job?
            for key, value in metric_values(url, "pdserve_requests_running").items():
                m = re.search(r'instance="(prefill-\d)"', key)
                if m and 'service="prefill"' in key and value > 0:
                    victim = m.group(1)
            time.sleep(0.1)
        assert victim, "no prefill worker reported the request as running"
        stack.process(victim).send_signal(signal.SIGKILL)
        thread.join(120)
        assert not thread.is_alive(), "the request hung"
        assert result["errors"] == []
        # the same answer as an undisturbed run of the same prompt (greedy, fp32)
        assert result["text"] == chat(url, long_prompt(1), max_tokens=12)["choices"][0]["message"]["content"]
    finally:
        stack.stop()


def test_only_decode_worker_killed_every_stream_ends_with_an_error(tmp_path_factory):
    """Migration limit 0: with the decode worker gone, each stream must end with an error event as
    soon as the gateway sees the worker dead (3 s without heartbeats) — none may hang."""
    stack, url = up(tmp_path_factory, "--prefill", "1", "--decode", "1", "--gateway-arg=--inactivity-timeout=5",
                    "--gateway-arg=--max-migrations=0")
    try:
        results = []
        threads = [threading.Thread(target=lambda i=i: results.append(
            stream_events(url, f"Tell me a long story number {i}.", 300))) for i in range(4)]
        for t in threads:
            t.start()
        time.sleep(3)  # the streams are decoding
        stack.process("decode-0").send_signal(signal.SIGKILL)
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a stream hung"
        assert len(results) == 4
        for text, errors, secs in results:
            assert errors, f"stream ended without an error event after {len(text)} chars"
            assert any("died" in e["message"] or "no tokens" in e["message"] for e in errors), errors
            assert secs < 3 + 5 + 10
    finally:
        stack.stop()


def test_decode_worker_killed_streams_migrate_and_complete(tmp_path_factory):
    """SIGKILL one of two decode workers while 6 streams decode: the gateway resubmits the dead
    worker's requests with the tokens already streamed, and every client receives exactly the
    undisturbed answer (no gap, no duplicate)."""
    stack, url = up(tmp_path_factory, "--prefill", "1", "--decode", "2", "--gateway-arg=--inactivity-timeout=30")
    prompts = [f"Write a short story about a robot named Unit {i}." for i in range(6)]
    try:
        expected = [chat(url, p, max_tokens=40)["choices"][0]["message"]["content"] for p in prompts]
        results: dict[int, tuple] = {}
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, stream_events(url, prompts[i], 40)))
                   for i in range(len(prompts))]
        log0 = stack.workdir / "decode-0.log"
        taken_before = log0.read_text().count("took request")
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while log0.read_text().count("took request") == taken_before and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # let it stream a few tokens
        t_kill = time.monotonic()
        stack.process("decode-0").send_signal(signal.SIGKILL)
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "a stream hung"
        recovery = time.monotonic() - t_kill
        for i, (text, errors, _) in results.items():
            assert errors == [], (i, errors)
            assert text == expected[i], i
        gateway_log = (stack.workdir / "gateway.log").read_text()
        assert "resubmitting (migration 1)" in gateway_log
        print(f"all {len(prompts)} streams completed {recovery:.1f} s after the kill")
    finally:
        stack.stop()
