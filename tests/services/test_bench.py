"""`pdserve bench`: the metrics math and accounting on synthetic records, workload determinism, the
SSE client and the runner against an in-process fake server, and (slow) the real CLI against a
real pdserve stack, including requests that must fail."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from services.bench.client import RequestRecord, Target, send
from services.bench.metrics import SLO, check_accounting, distribution, itls_after, percentile, summarize
from services.bench.report import format_result, write_json
from services.bench.runner import BenchConfig, run_benchmark_async
from services.bench.workloads import RequestSpec, TextGenerator, Workload, parse_range, poisson_offsets


def record(index=0, sent=0.0, tokens=(), end=None, out=None, status="ok", max_tokens=None, kind="chat") -> RequestRecord:
    tokens = list(tokens)
    n = len(tokens) if out is None else out
    return RequestRecord(index, kind, max_tokens or n, 100, 0.0, sent_s=sent, end_s=end if end is not None else
                         (tokens[-1] if tokens else sent), token_times_s=tokens, output_tokens=n, status=status,
                         done=status == "ok")


# ----------------------------------------------------------------------------------------- metrics


def test_percentile_matches_numpy_linear_interpolation():
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 100):
        values = rng.exponential(size=n).tolist()
        for q in (0, 50, 90, 99, 100):
            assert percentile(values, q) == pytest.approx(np.percentile(values, q))
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    with pytest.raises(ValueError):
        percentile([], 50)


def test_distribution_is_in_ms_ordered_and_none_when_empty():
    d = distribution([0.001 * x for x in range(1, 101)])
    assert d["n"] == 100 and d["min"] == pytest.approx(1.0) and d["max"] == pytest.approx(100.0)
    assert d["mean"] == pytest.approx(50.5)
    assert d["min"] <= d["p50"] <= d["p90"] <= d["p99"] <= d["max"]
    assert distribution([]) is None


def test_ttft_tpot_itl_e2el_of_one_record():
    r = record(sent=1.0, tokens=[1.1, 1.2, 1.25, 1.45], end=1.5, out=4)
    assert r.ttft_s == pytest.approx(0.1)
    assert r.e2el_s == pytest.approx(0.5)
    assert r.tpot_s == pytest.approx((1.5 - 1.1) / 3)  # (E2EL − TTFT) / (tokens − 1)
    assert r.itls_s == pytest.approx([0.1, 0.05, 0.2])
    assert itls_after(r, 1.22) == pytest.approx([0.05, 0.2])  # only gaps ending in the window
    assert record(tokens=[0.1], out=1).tpot_s is None  # one token has no TPOT


def test_tpot_uses_the_servers_token_count_not_chunks():
    # 3 chunks carried 5 tokens (the server said so in usage): TPOT divides by 4, not 2
    r = record(tokens=[0.1, 0.2, 0.5], end=0.5, out=5)
    assert r.tpot_s == pytest.approx(0.4 / 4)


def test_summary_accounts_for_every_request_and_counts_only_completed_tokens():
    recs = [record(0, tokens=[0.1, 0.2, 0.3], out=3),
            record(1, tokens=[0.2, 0.4], out=2),
            record(2, status="http_error"),
            record(3, tokens=[0.1], out=1, status="cut_off"),
            record(4, status="timeout"),
            record(5, tokens=[0.3, 0.5], out=2, status="sse_error")]
    s = summarize(recs, duration_s=2.0)
    assert (s["sent"], s["completed"], s["failed"]) == (6, 2, 4)
    assert s["failures"] == {"http_error": 1, "sse_error": 1, "cut_off": 1, "timeout": 1}
    assert s["total_output_tokens"] == 5 and s["output_tokens_of_failed"] == 3
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(2.5)
    assert s["total_token_throughput"] == pytest.approx((200 + 5) / 2.0)
    assert s["ttft_ms"]["n"] == 2 and s["itl_ms"]["n"] == 3  # failed requests' latencies are not mixed in
    assert s["goodput"] is None  # no SLO given
    broken = dict(s, failed=3)
    with pytest.raises(AssertionError, match="accounting"):
        check_accounting(broken)


def test_goodput_and_slo_attainment():
    recs = [record(0, tokens=[0.1, 0.12, 0.14], out=3),  # TTFT 100 ms, TPOT 20 ms: good
            record(1, tokens=[0.6, 0.62, 0.64], out=3),  # TTFT 600 ms: misses the TTFT SLO
            record(2, tokens=[0.1, 0.2, 0.3], out=3),  # TPOT 100 ms: misses the TPOT SLO
            record(3, tokens=[0.05], out=1),  # one token: no TPOT to miss
            record(4, status="http_error")]  # failed: never good
    s = summarize(recs, duration_s=4.0, slo=SLO(ttft_ms=500, tpot_ms=50))
    g = s["goodput"]
    assert g["good"] == 2
    assert g["request_goodput"] == pytest.approx(0.5)
    assert g["attainment_pct"] == pytest.approx(40.0)  # of everything sent
    assert summarize(recs, 4.0, SLO(ttft_ms=500))["goodput"]["good"] == 3
    assert summarize(recs, 4.0, SLO(tpot_ms=50))["goodput"]["good"] == 3


def test_summary_by_kind_and_itl_window():
    recs = [record(0, tokens=[1.0, 1.1, 3.1, 3.2], kind="chat"), record(1, sent=2.0, tokens=[3.0, 3.05], kind="long")]
    s = summarize(recs, duration_s=4.0, itl_from_s=2.0)
    chat = s["by_kind"]["chat"]
    assert chat["itl_ms"]["n"] == 2 and chat["itl_ms"]["max"] == pytest.approx(2000.0)  # the 0.1 s gap before t=2 is out
    assert s["by_kind"]["long"]["ttft_ms"]["max"] == pytest.approx(1000.0)


# ---------------------------------------------------------------------------------------- workloads


def test_same_seed_same_trace_and_requests_independent_of_order():
    for name in ("chat", "long-doc", "shared-prefix", "grounded", "open"):
        a, b = Workload(name, seed=7), Workload(name, seed=7)
        trace = [a.request(i) for i in range(5)]
        assert trace == [b.request(i) for i in reversed(range(5))][::-1]
        assert trace != [Workload(name, seed=8).request(i) for i in range(5)]
        assert len({r.prompt for r in trace}) == 5
    offsets = lambda seed: [t for t, _ in zip(poisson_offsets(2.0, seed), range(200))]  # noqa: E731
    assert offsets(1) == offsets(1) and offsets(1) != offsets(2)
    assert offsets(1)[0] == 0.0 and all(b >= a for a, b in zip(offsets(1), offsets(1)[1:]))
    assert 199 / offsets(1)[-1] == pytest.approx(2.0, rel=0.25)  # mean rate ≈ 2 req/s
    assert [t for t, _ in zip(poisson_offsets(math.inf, 0), range(3))] == [0.0, 0.0, 0.0]


def test_workload_ranges_and_shared_prefix():
    chat = [Workload("chat", 0).request(i) for i in range(50)]
    assert all(100 <= r.prompt_tokens <= 300 and 128 <= r.max_tokens <= 256 for r in chat)
    long = [Workload("long-doc", 0).request(i) for i in range(20)]
    assert all(1500 <= r.prompt_tokens <= 3000 and 32 <= r.max_tokens <= 128 for r in long)
    w = Workload("shared-prefix", 0, prefix_tokens=1000)
    reqs = [w.request(i) for i in range(4)]
    assert all(r.prompt.startswith(w.shared_prefix()) for r in reqs)
    assert len({r.prompt[len(w.shared_prefix()):] for r in reqs}) == 4
    grounded = [Workload("grounded", 0).request(i) for i in range(6)]  # code edit, quoting summary, extraction
    assert all(64 <= r.max_tokens <= 160 for r in grounded)
    assert "def " in grounded[0].prompt and "return the whole function" in grounded[0].prompt
    assert "quoting its sentences" in grounded[1].prompt and "JSON lines" in grounded[2].prompt
    assert "def " in grounded[3].prompt and grounded[3].prompt != grounded[0].prompt
    fixed = Workload("chat", 0, prompt_tokens=(50, 50), output_tokens=(8, 8))
    assert {(r.prompt_tokens, r.max_tokens) for r in (fixed.request(i) for i in range(5))} == {(50, 8)}
    assert parse_range("16") == (16, 16) and parse_range("8-32") == (8, 32)
    with pytest.raises(ValueError):
        parse_range("9-3")


def test_text_generator_hits_exact_lengths_with_a_tokenizer():
    import random

    count = lambda text: len(text.split())  # noqa: E731  (a "tokenizer" whose tokens are words)
    gen = TextGenerator(count)
    for n in (1, 37, 500):
        assert count(gen.text(random.Random(n), n)) == n


# ----------------------------------------------------------------------- client and runner (fake server)


class FakeServer:
    """An OpenAI-style SSE server in process: `n` tokens per request (its max_tokens), one chunk each,
    a few ms apart; the prompt picks a failure mode. Tracks how many requests are in flight."""

    def __init__(self, gap_s: float = 0.002):
        self.gap_s = gap_s
        self.in_flight = self.max_in_flight = 0
        self.bodies: list[dict] = []

    async def handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.bodies.append(body)
        prompt = body.get("prompt") or body["messages"][0]["content"]
        if "http-error" in prompt:
            return httpx.Response(400, json={"error": {"message": "prompt too long", "code": "bad"}})
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=self._events(body, prompt))

    async def _events(self, body, prompt):
        # in flight from the first event to the last one (the client stops reading at [DONE], so a
        # `finally` here would run late)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        n = body["max_tokens"] - (1 if "short" in prompt else 0)
        chat = "messages" in body
        for i in range(n):
            await asyncio.sleep(self.gap_s)
            if "sse-error" in prompt and i == 2:
                self.in_flight -= 1
                yield b'data: {"error": {"message": "worker lost", "code": "worker_lost"}}\n\ndata: [DONE]\n\n'
                return
            choice = {"delta": {"content": f" t{i}"}} if chat else {"text": f" t{i}"}
            yield f"data: {json.dumps({'choices': [choice | {'finish_reason': None}]})}\n\n".encode()
        self.in_flight -= 1
        yield (b'data: {"choices": [{"text": "", "finish_reason": "length"}], "usage": {"prompt_tokens": 42, '
               b'"completion_tokens": ' + str(n).encode() + b'}}\n\n' + (b"" if "no-done" in prompt else b"data: [DONE]\n\n"))


async def fake_send(prompt: str, max_tokens: int = 5, endpoint: str = "completions") -> RequestRecord:
    server = FakeServer()
    async with httpx.AsyncClient(transport=httpx.MockTransport(server.handle)) as client:
        return await send(client, Target("http://fake", "m", endpoint), RequestSpec(0, "chat", prompt, max_tokens, 10),
                          t0=0.0, scheduled_s=0.0)


async def test_client_statuses():
    ok = await fake_send("fine")
    assert ok.status == "ok" and ok.output_tokens == 5 and len(ok.token_times_s) == 5 and ok.prompt_tokens == 42
    assert ok.usage_reported and ok.done and ok.finish_reason == "length"
    chat = await fake_send("fine", endpoint="chat")
    assert chat.status == "ok" and len(chat.token_times_s) == 5
    http = await fake_send("http-error please")
    assert http.status == "http_error" and http.http_status == 400 and "prompt too long" in http.error
    sse = await fake_send("sse-error please")
    assert sse.status == "sse_error" and "worker lost" in sse.error and len(sse.token_times_s) == 2
    short = await fake_send("short please")
    assert short.status == "cut_off" and "4 of 5" in short.error
    no_done = await fake_send("no-done please")
    assert no_done.status == "cut_off" and "[DONE]" in no_done.error


async def test_client_timeout_and_connection_error():
    server = FakeServer(gap_s=0.5)
    async with httpx.AsyncClient(transport=httpx.MockTransport(server.handle)) as client:
        target = Target("http://fake", "m", request_timeout_s=0.2)
        rec = await send(client, target, RequestSpec(0, "chat", "x", 5, 1), 0.0, 0.0)
    assert rec.status == "timeout"

    def refuse(request):
        raise httpx.ConnectError("connection refused")

    async with httpx.AsyncClient(transport=httpx.MockTransport(refuse)) as client:
        rec = await send(client, Target("http://fake", "m"), RequestSpec(0, "chat", "x", 5, 1), 0.0, 0.0)
    assert rec.status == "connection_error" and "refused" in rec.error


async def test_runner_closed_loop_respects_concurrency_and_accounts_for_all(tmp_path):
    server = FakeServer()
    lines = [{"prompt": "fine", "max_tokens": 6}, {"prompt": "http-error", "max_tokens": 6},
             {"prompt": "short", "max_tokens": 6}, {"prompt": "fine too", "max_tokens": 3}]
    dataset = tmp_path / "d.jsonl"
    dataset.write_text("\n".join(json.dumps(x) for x in lines))
    config = BenchConfig("http://fake", model="m", dataset=str(dataset), num_requests=10, max_concurrency=3,
                         slo=SLO(ttft_ms=10_000), progress=False)
    before = time.time()
    result = await run_benchmark_async(config, transport=httpx.MockTransport(server.handle))
    (run,) = result.runs
    s = run.summary
    assert s["sent"] == 10 and s["completed"] + s["failed"] == 10
    assert s["failures"] == {"http_error": 3, "cut_off": 2}  # requests 1, 5, 9 and 2, 6 of the cycled dataset
    assert server.max_in_flight <= 3
    assert all(b["ignore_eos"] and b["temperature"] == 0.0 and b["stream"] for b in server.bodies)
    assert s["goodput"]["good"] == 5
    text = format_result(result)
    assert "Failed requests" in text and "#1 (dataset) http_error" in text
    write_json(result, tmp_path / "r.json")
    data = json.loads((tmp_path / "r.json").read_text())
    assert len(data["runs"][0]["records"]) == 10
    # the records' times count from the run's start, which the result gives in wall-clock time (to line
    # them up with the servers' logs): the last record ended at that start + its end_s, before now
    start = data["runs"][0]["started_unix_s"]
    assert before <= start <= start + max(r["end_s"] for r in data["runs"][0]["records"]) <= time.time()


async def test_runner_rate_sweep_and_interference():
    server = FakeServer(gap_s=0.001)
    sweep = BenchConfig("http://fake", model="m", num_requests=6, request_rates=(50.0, 100.0),
                        output_tokens=(4, 4), prompt_tokens=(20, 20), progress=False)
    result = await run_benchmark_async(sweep, transport=httpx.MockTransport(server.handle))
    assert [r.request_rate for r in result.runs] == [50.0, 100.0]
    assert all(r.summary["completed"] == 6 for r in result.runs)
    assert [r.scheduled_s for r in result.runs[0].records] == [t for t, _ in zip(poisson_offsets(50.0, 0), range(6))]
    prompts = [b["prompt"] for b in server.bodies]
    assert len(prompts) == 12 and len(set(prompts)) == 12  # no prompt twice: it would hit the prefix cache

    mix = BenchConfig("http://fake", model="m", workload="interference", duration_s=0.5, max_concurrency=2,
                      output_tokens=(10, 10), long_output_tokens=(3, 3), long_prompt_tokens=(50, 50),
                      long_interval_s=0.2, warmup_s=0.1, progress=False)
    result = await run_benchmark_async(mix, transport=httpx.MockTransport(server.handle))
    base, long = result.runs
    assert (base.label, long.label) == ("baseline", "with long prompts")
    assert not base.long_arrivals_s and len(long.long_arrivals_s) == 2  # at 0.1 and 0.3 s
    assert long.summary["by_kind"]["long"]["sent"] == 2
    assert result.interference["ratio"] > 0
    base_prompts = {r.index for r in base.records}
    assert not base_prompts & {r.index for r in long.records if r.kind == "chat"}  # each phase its own chat prompts


# --------------------------------------------------------------------- the real CLI, a real stack


def _walk_numbers(obj, path=""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _walk_numbers(v, f"{path}.{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _walk_numbers(v, f"{path}[{i}]")
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        yield path, obj


def _check_report(data: dict) -> None:
    for run in data["runs"]:
        s = run["summary"]
        assert s["completed"] + s["failed"] == s["sent"] == len(run["records"])
        assert sum(s["failures"].values()) == s["failed"]
        assert sum(1 for r in run["records"] if r["status"] != "ok") == s["failed"]
        for path, value in _walk_numbers(s):
            assert value >= 0, path
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            d = s[key]
            if d is not None:
                assert d["min"] <= d["p50"] <= d["p90"] <= d["p99"] <= d["max"], (key, d)
        for r in run["records"]:
            assert 0 <= r["sent_s"] <= r["end_s"]
            assert r["token_times_s"] == sorted(r["token_times_s"])


def _bench(url: str, tmp: Path, name: str, *args: str) -> dict:
    out = tmp / f"{name}.json"
    proc = subprocess.run([sys.executable, "-m", "services.cli", "bench", "--base-url", url, "--no-progress",
                           "--out", str(out), *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    data["stdout"] = proc.stdout
    return data


@pytest.mark.slow
def test_cli_against_a_real_stack(tmp_path):
    from services.up import add_up_args, start_stack, wait_healthy
    from shared.transport.servers import free_port

    parser = argparse.ArgumentParser()
    add_up_args(parser)
    stack, url = start_stack(parser.parse_args(["--port", str(free_port()), "--workdir", str(tmp_path / "stack")]))
    try:
        wait_healthy(stack, url, timeout=120)
        plots = tmp_path / "plots"
        data = _bench(url, tmp_path, "chat", "--workload", "chat", "--num-requests", "6", "--max-concurrency", "3",
                      "--input-len", "60-120", "--output-len", "8-16", "--slo-ttft-ms", "60000",
                      "--slo-tpot-ms", "5000", "--plots", str(plots))
        _check_report(data)
        (run,) = data["runs"]
        s = run["summary"]
        assert (s["sent"], s["completed"], s["failed"]) == (6, 6, 0), data["stdout"]
        for r in run["records"]:
            assert 8 <= r["max_tokens"] <= 16 and r["output_tokens"] == r["max_tokens"] and r["usage_reported"]
        assert s["total_output_tokens"] == sum(r["max_tokens"] for r in run["records"])
        assert s["goodput"]["good"] == 6 and s["goodput"]["attainment_pct"] == 100.0
        assert "Time to First Token" in data["stdout"]
        for name in ("latency_cdfs.png", "itl_over_time.png"):
            assert (plots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

        # some requests must fail: a prompt longer than the model's context, between good ones
        dataset = tmp_path / "mixed.jsonl"
        dataset.write_text("\n".join([json.dumps({"prompt": "Tell me a story.", "max_tokens": 6}),
                                      json.dumps({"prompt": "word " * 10_000, "max_tokens": 6})]))
        data = _bench(url, tmp_path, "mixed", "--dataset", str(dataset), "--num-requests", "4",
                      "--max-concurrency", "2", "--endpoint", "chat")
        _check_report(data)
        s = data["runs"][0]["summary"]
        assert (s["sent"], s["completed"], s["failed"], s["failures"]) == (4, 2, 2, {"http_error": 2})
        assert "Failed requests" in data["stdout"] and "maximum context length" in data["stdout"]

        # every request fails: a model this server does not serve
        data = _bench(url, tmp_path, "wrong-model", "--model", "no-such-model", "--num-requests", "3",
                      "--output-len", "4")
        s = data["runs"][0]["summary"]
        assert (s["sent"], s["completed"], s["failed"]) == (3, 0, 3)
        assert all(r["http_status"] == 404 for r in data["runs"][0]["records"])
        assert s["ttft_ms"] is None and s["request_throughput"] == 0
    finally:
        stack.stop()
