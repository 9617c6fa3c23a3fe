"""End to end: real nats-server, valkey-server, kvstore, prefill, decode and gateway processes, the
real model, real HTTP. What a user of `pdserve up` sees."""

from __future__ import annotations

import argparse
import json
import random
import re
import string
import threading
import time
from pathlib import Path

import httpx
import pytest

from services.up import add_up_args, start_stack, wait_healthy
from shared.config import EngineConfig, SpecConfig
from shared.engine.engine import LLMEngine
from shared.model.chat_template import render_chat
from shared.model.sampling_params import Constraint, SamplingParams

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"
MODEL = "SmolLM2-135M-Instruct"


def up(tmp_path_factory, *extra: str):
    """Start a pdserve stack with its own nats-server and valkey-server, in the default configuration
    (whose greedy output does not depend on batching, chunking or the prefix cache)."""
    from shared.transport.servers import free_port

    parser = argparse.ArgumentParser()
    add_up_args(parser)
    args = parser.parse_args(["--port", str(free_port()), "--workdir", str(tmp_path_factory.mktemp("stack")), *extra])
    stack, url = start_stack(args)
    try:
        wait_healthy(stack, url, timeout=120)
    except BaseException:
        stack.stop()
        raise
    return stack, url


@pytest.fixture(scope="module")
def disagg_stack(tmp_path_factory):
    stack, url = up(tmp_path_factory, "--prefill", "1", "--decode", "2")
    yield stack, url
    stack.stop()


@pytest.fixture(scope="module")
def disagg(disagg_stack):
    return disagg_stack[1]


def chat(url: str, content: str, max_tokens: int = 32, **extra) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0.0, **extra}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def stream_chat(url: str, content: str, max_tokens: int = 32, **extra) -> tuple[str, list[dict]]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}, **extra}
    chunks, text = [], ""
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        chunk = json.loads(line[6:])
        assert "error" not in chunk, chunk
        chunks.append(chunk)
        for choice in chunk["choices"]:
            text += choice["delta"].get("content") or ""
    return text, chunks


def metric_values(url: str, name: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        m = re.match(rf"^{name}(\{{[^}}]*\}})?\s+([0-9.eE+-]+)$", line)
        if m:
            out[m.group(1) or ""] = float(m.group(2))
    return out


def offline(content: str, **params):
    """The offline engine's output for a chat turn, without speculative decoding (the stack runs with it)."""
    engine = LLMEngine.from_config(EngineConfig(num_kv_blocks=128, speculative=SpecConfig(mode="off")))
    tok = engine.tokenizer
    ids = tok.encode(render_chat(tok.chat_template, [{"role": "user", "content": content}]), add_special_tokens=False)
    [out] = engine.generate([ids], SamplingParams(**{"temperature": 0.0} | params))
    return out


def offline_greedy(content: str, max_tokens: int) -> str:
    return offline(content, max_tokens=max_tokens).text


def test_streaming_chat_answers_with_the_real_model(disagg):
    text, chunks = stream_chat(disagg, QUESTION)
    assert "Paris" in text
    assert chunks[0]["choices"][0]["delta"].get("role") == "assistant"
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] > 0 and usage["prompt_tokens"] > 20
    assert chunks[-2]["choices"][0]["finish_reason"] in ("stop", "length")


def test_greedy_output_matches_offline_engine(disagg):
    """The disaggregated stack gives the offline engine's greedy text, token for token — asked twice,
    the second time with the prompt's blocks in the prefix cache."""
    prompts = [QUESTION, "Write one sentence about the sea.", "List three fruits."]
    for p in prompts:
        offline = offline_greedy(p, 24)
        for _ in range(2):
            assert chat(disagg, p, max_tokens=24)["choices"][0]["message"]["content"] == offline


def test_speculative_decoding_across_the_split(disagg):
    """The decode worker speculates on what it got from the prefill worker with nothing extra moved:
    a prompt the answer repeats is answered as without speculation, with proposals accepted, in the
    usage and in the metrics."""
    p = "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog near the river bank."
    offline = offline_greedy(p, 40)
    body = chat(disagg, p, max_tokens=40)
    assert body["choices"][0]["message"]["content"] == offline
    text, chunks = stream_chat(disagg, p, max_tokens=40)
    assert text == offline
    # how much is proposed is the worker's decision, from measured step times: in total, not per request
    usages = [body["usage"], chunks[-1]["usage"]]
    assert all(0 <= u["accepted_tokens"] <= u["draft_tokens"] for u in usages)
    assert all(u["completion_tokens_details"]["accepted_prediction_tokens"] == u["accepted_tokens"] for u in usages)
    assert sum(u["accepted_tokens"] for u in usages) > 0, usages
    deadline = time.time() + 10
    while time.time() < deadline:  # workers publish their counters with each heartbeat
        accepted = metric_values(disagg, "pdserve_spec_decode_num_accepted_tokens_total")
        if sum(v for k, v in accepted.items() if 'service="decode"' in k) > 0:
            break
        time.sleep(0.5)
    else:
        raise AssertionError(f"no accepted speculative tokens in /metrics: {accepted}")


def test_openai_client_unmodified(disagg):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{disagg}/v1", api_key="unused")
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                          max_tokens=24, temperature=0)
    assert "Paris" in resp.choices[0].message.content
    assert resp.usage.completion_tokens > 0
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=24, temperature=0, stream=True)
        if c.choices]
    assert "".join(pieces) == resp.choices[0].message.content
    comp = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert comp.choices[0].text.strip()
    assert [m.id for m in client.models.list().data]


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "hobbies"],
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3}}}


def test_structured_output_across_the_split_with_the_openai_client(disagg):
    """response_format json_schema / json_object and vLLM's guided_* through the official client:
    prefill samples token 0 under the grammar, decode continues it; streamed = not streamed = the
    offline engine; a schema that does not compile is a 400 naming it."""
    openai = pytest.importorskip("openai")
    jsonschema = pytest.importorskip("jsonschema")
    client = openai.OpenAI(base_url=f"{disagg}/v1", api_key="unused")
    ask = [{"role": "user", "content": "Describe a person as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    resp = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=120, temperature=0,
                                          response_format=fmt)
    text = resp.choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)
    assert resp.choices[0].finish_reason == "stop"
    assert text == offline(ask[0]["content"], max_tokens=120,
                           constraint=Constraint("json", json.dumps(PERSON))).text
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=ask, max_tokens=120, temperature=0, response_format=fmt, stream=True) if c.choices)
    assert streamed == text
    # sampled under the schema (its lengths bound the answer), and a free-form object greedily
    seeded = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=200, temperature=1.0, seed=5,
                                            response_format=fmt)
    assert seeded.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(seeded.choices[0].message.content), PERSON)
    short = [{"role": "user", "content": f"{QUESTION} Answer as a JSON object with the key \"capital\"."}]
    free = client.chat.completions.create(model=MODEL, messages=short, max_tokens=60, temperature=0,
                                          response_format={"type": "json_object"})
    assert free.choices[0].finish_reason == "stop", free.choices[0].message.content
    assert isinstance(json.loads(free.choices[0].message.content), dict)
    phone = client.completions.create(model=MODEL, prompt="Call me at", max_tokens=20, temperature=0.9, seed=2,
                                      extra_body={"guided_regex": r" [0-9]{3}-[0-9]{4}"})
    assert re.fullmatch(r" [0-9]{3}-[0-9]{4}", phone.choices[0].text)
    pick = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                          max_tokens=8, temperature=0,
                                          extra_body={"guided_choice": ["Paris", "Lyon", "Nice"]})
    assert pick.choices[0].message.content in ("Paris", "Lyon", "Nice")
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=ask, max_tokens=8, response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "strnig"}}})
    assert "strnig" in str(err.value)


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "description": "The time in a timezone",
                                              "parameters": {"type": "object", "additionalProperties": False,
                                                             "required": ["tz"],
                                                             "properties": {"tz": {"type": "string", "maxLength": 30}}}}}


def test_tools_with_the_openai_client(disagg):
    """tools + tool_choice through the official client: a named function forces its arguments'
    schema, "required" forces a call of one of the tools, "auto" is parsed the same streamed or not,
    and a conversation with a tool result goes on."""
    openai = pytest.importorskip("openai")
    jsonschema = pytest.importorskip("jsonschema")
    client = openai.OpenAI(base_url=f"{disagg}/v1", api_key="unused")
    ask = [{"role": "user", "content": "What is the weather like in Paris?"}]
    tools = [WEATHER_TOOL, TIME_TOOL]
    named = {"type": "function", "function": {"name": "get_weather"}}
    resp = client.chat.completions.create(model=MODEL, messages=ask, tools=tools, tool_choice=named,
                                          max_tokens=60, temperature=0)
    choice = resp.choices[0]
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and choice.finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])
    args, names = "", []
    for chunk in client.chat.completions.create(model=MODEL, messages=ask, tools=tools, tool_choice=named,
                                                max_tokens=60, temperature=0, stream=True):
        for delta_call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            names += [delta_call.function.name] if delta_call.function.name else []
            args += delta_call.function.arguments or ""
    assert names == ["get_weather"] and args == call.function.arguments

    required = client.chat.completions.create(model=MODEL, messages=ask, tools=tools, tool_choice="required",
                                              max_tokens=80, temperature=0)
    calls = required.choices[0].message.tool_calls
    assert calls and required.choices[0].finish_reason == "tool_calls"
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), by_name[c.function.name])

    auto = client.chat.completions.create(model=MODEL, messages=ask, tools=tools, max_tokens=60, temperature=0)
    streamed_text, streamed_calls = "", {}
    for chunk in client.chat.completions.create(model=MODEL, messages=ask, tools=tools, max_tokens=60,
                                                temperature=0, stream=True):
        if chunk.choices:
            streamed_text += chunk.choices[0].delta.content or ""
            for c in chunk.choices[0].delta.tool_calls or []:
                streamed_calls[c.index] = (c.function.name, c.function.arguments)
    message = auto.choices[0].message
    assert streamed_text.strip() == (message.content or "").strip()
    assert list(streamed_calls.values()) == [(c.function.name, c.function.arguments) for c in message.tool_calls or []]

    history = ask + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                         "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'}]
    answer = client.chat.completions.create(model=MODEL, messages=history, tools=tools, tool_choice="none",
                                            max_tokens=40, temperature=0)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=ask, tools=tools, max_tokens=8,
                                       tool_choice={"type": "function", "function": {"name": "get_stock"}})
    assert "get_stock" in str(err.value)


def _busy_by_role(url: str, metric: str = "pdserve_engine_busy_seconds_total") -> dict[str, float]:
    """A worker counter summed per worker role, once two heartbeats agree."""
    previous = None
    for _ in range(20):
        values = metric_values(url, metric)
        by_role: dict[str, float] = {}
        for labels, v in values.items():
            role = re.search(r'service="([^"]+)"', labels).group(1)
            by_role[role] = by_role.get(role, 0.0) + v
        if by_role == previous:
            return by_role
        previous = by_role
        time.sleep(1.2)
    raise AssertionError("the workers' busy time never settled")


def test_cost_breakdown_conserves_every_workers_busy_time(disagg):
    """≥ 50 mixed requests (chat and completions, streamed and not, short and long prompts, n = 2,
    8 at a time so steps are shared): the prefill-seconds and decode-seconds in the responses add
    up to the workers' measured step time, and the gateway's counters to the responses' values."""
    from concurrent.futures import ThreadPoolExecutor

    rng = random.Random(13)
    before_busy = _busy_by_role(disagg)
    before_core = _busy_by_role(disagg, "pdserve_engine_busy_core_seconds_total")
    counters = ("pdserve_prefill_seconds_total", "pdserve_decode_seconds_total", "pdserve_kv_transfer_bytes_total")
    before = {name: sum(metric_values(disagg, name).values()) for name in counters}

    def one(i: int) -> dict:
        words = " ".join(rng.choice(["river", "stone", "light", "market", "engine", "cloud"]) for _ in range(
            rng.choice([5, 40, 200])))
        body = {"model": MODEL, "max_tokens": rng.randint(4, 40), "temperature": 0.0, "ignore_eos": True,
                "n": 2 if i % 10 == 0 else 1}
        chat_kind = i % 2 == 0
        if chat_kind:
            body["messages"] = [{"role": "user", "content": f"Summarise: {words}"}]
        else:
            body["prompt"] = f"Notes {i}: {words}"
        path = "/v1/chat/completions" if chat_kind else "/v1/completions"
        if i % 3 == 0:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
            with httpx.stream("POST", f"{disagg}{path}", json=body, timeout=120) as r:
                assert r.status_code == 200
                chunks = [json.loads(line[6:]) for line in r.iter_lines()
                          if line.startswith("data: ") and line != "data: [DONE]"]
            return chunks[-1]["usage"]
        r = httpx.post(f"{disagg}{path}", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["usage"]

    with ThreadPoolExecutor(8) as pool:
        usages = list(pool.map(one, range(52)))
    after_busy = _busy_by_role(disagg)
    after_core = _busy_by_role(disagg, "pdserve_engine_busy_core_seconds_total")
    after = {name: sum(metric_values(disagg, name).values()) for name in counters}
    prefill = sum(u["cost"]["prefill_seconds"] for u in usages)
    decode = sum(u["cost"]["decode_seconds"] for u in usages)
    kv_bytes = sum(u["cost"]["kv_bytes"] for u in usages)
    busy = {role: after_busy[role] - before_busy.get(role, 0.0) for role in after_busy}
    print(f"prefill {prefill:.3f} s vs prefill workers busy {busy['prefill']:.3f} s; decode {decode:.3f} s vs "
          f"decode workers busy {busy['decode']:.3f} s; KV moved {kv_bytes / 1e6:.1f} MB")
    assert prefill > 0 and decode > 0 and kv_bytes > 0
    assert prefill == pytest.approx(busy["prefill"], rel=0.05)
    assert decode == pytest.approx(busy["decode"], rel=0.05)
    for phase in ("prefill", "decode"):  # core-seconds (what --price charges): the same, step by step
        charged = sum(u["cost"][f"{phase}_core_seconds"] for u in usages)
        assert charged == pytest.approx(after_core[phase] - before_core.get(phase, 0.0), rel=0.05)
    assert after["pdserve_prefill_seconds_total"] - before["pdserve_prefill_seconds_total"] == pytest.approx(prefill)
    assert after["pdserve_decode_seconds_total"] - before["pdserve_decode_seconds_total"] == pytest.approx(decode)
    assert after["pdserve_kv_transfer_bytes_total"] - before["pdserve_kv_transfer_bytes_total"] == kv_bytes
    for u in usages:
        assert set(u["timing_ms"]) == {"queue", "prefill", "kv_transfer", "decode_queue", "decode"}
        assert u["timing_ms"]["decode"] > 0 and u["cost"]["kv_transfer_seconds"] > 0


def test_pdserve_cost_from_a_bench_run_and_from_the_live_gateway(disagg, tmp_path):
    """`pdserve bench --out` records each request's usage.cost; `pdserve cost` turns it into a
    per-phase table (and side by side with another run), and reads a live gateway's counters."""
    import subprocess
    import sys

    out = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, "-m", "services.cli", "bench", "--base-url", disagg, "--workload", "chat",
                          "--num-requests", "12", "--max-concurrency", "4", "--input-len", "64-160",
                          "--output-len", "8-24", "--no-progress", "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    records = [r for run_ in json.loads(out.read_text())["runs"] for r in run_["records"] if r["status"] == "ok"]
    assert len(records) == 12 and all(r["cost"]["prefill_seconds"] > 0 and r["cost"]["decode_seconds"] > 0
                                      for r in records)
    table = tmp_path / "cost.json"
    cost = subprocess.run([sys.executable, "-m", "services.cli", "cost", str(out), "--compare", str(out),
                           "--price", "prefill=2,decode=1,gb=0.5,currency=EUR", "--json", str(table)],
                          capture_output=True, text=True, timeout=60)
    assert cost.returncode == 0, cost.stderr
    assert "total EUR / 1k requests" in cost.stdout and "1.00×" in cost.stdout
    numbers = json.loads(table.read_text())["bench"]
    prefill = sum(r["cost"]["prefill_core_seconds"] for r in records)
    decode = sum(r["cost"]["decode_core_seconds"] for r in records)
    kv_gb = sum(r["cost"]["kv_bytes"] for r in records) / 1e9
    assert numbers["requests"] == 12
    assert numbers["prefill core-seconds / 1k requests"] == pytest.approx(prefill * 1000 / 12)
    assert numbers["total EUR / 1k requests"] == pytest.approx((2 * prefill + decode + 0.5 * kv_gb) * 1000 / 12)
    live = subprocess.run([sys.executable, "-m", "services.cli", "cost", "--url", disagg],
                          capture_output=True, text=True, timeout=60)
    assert live.returncode == 0 and "prefill-seconds / 1k requests" in live.stdout, live.stderr


def test_logprobs_and_penalties_across_the_split(disagg):
    """Log-probabilities (the prefill worker's for token 0, the decode worker's for the rest, under
    speculation) equal the offline engine's; streamed they are the same as in one body; the official
    client reads them; a penalty gives the offline engine's penalized answer."""
    want = offline(QUESTION, max_tokens=24, logprobs=5)
    body = chat(disagg, QUESTION, max_tokens=24, logprobs=True, top_logprobs=5)
    content = body["choices"][0]["logprobs"]["content"]
    assert body["choices"][0]["message"]["content"] == want.text
    assert len(content) == body["usage"]["completion_tokens"] == len(want.logprobs)
    # every output token has its entry, the end-of-turn token too (its text is not in the content)
    assert content[-1]["token"] == "<|im_end|>" and body["choices"][0]["finish_reason"] == "stop"
    assert b"".join(bytes(c["bytes"]) for c in content[:-1]).decode() == want.text
    for c, lp in zip(content, want.logprobs):
        assert c["logprob"] == pytest.approx(lp.logprob, abs=1e-4)
        assert [t["logprob"] for t in c["top_logprobs"]] == pytest.approx(lp.top_logprobs, abs=1e-4)
        assert c["top_logprobs"][0]["token"] == c["token"]  # greedy: the most likely
    _, chunks = stream_chat(disagg, QUESTION, max_tokens=24, logprobs=True, top_logprobs=5)
    streamed = [c for ch in chunks for choice in ch["choices"] for c in (choice.get("logprobs") or {}).get("content", [])]
    assert streamed == content

    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{disagg}/v1", api_key="unused")
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                          max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    assert [t.token for t in resp.choices[0].logprobs.content] == [c["token"] for c in content[:8]]
    assert all(len(t.top_logprobs) == 3 for t in resp.choices[0].logprobs.content)

    prompt = "The capital of France is"
    completion = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    choice = httpx.post(f"{disagg}/v1/completions", json=completion | {"logprobs": 2}, timeout=60).json()["choices"][0]
    echoed = httpx.post(f"{disagg}/v1/completions", json=completion | {"echo": True}, timeout=60).json()["choices"][0]
    assert echoed["text"] == prompt + choice["text"]
    lps = choice["logprobs"]
    assert "".join(lps["tokens"]) == choice["text"]
    assert lps["text_offset"] == sorted(lps["text_offset"]) and lps["text_offset"][0] == 0
    assert all(len(top) <= 2 for top in lps["top_logprobs"]) and all(v <= 0 for v in lps["token_logprobs"])

    story = "Write a short story about a cat."
    plain = offline(story, max_tokens=40)
    penalized = offline(story, max_tokens=40, frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.2)
    assert penalized.text != plain.text
    got = chat(disagg, story, max_tokens=40, frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.2)
    assert got["choices"][0]["message"]["content"] == penalized.text


def test_echo_with_logprobs_gives_the_prompts_log_likelihood(disagg):
    """Completions echo + logprobs (what log-likelihood evaluation sends): the prompt's tokens with
    their log-probabilities, computed in prefill and carried to the client with token 0 — equal to
    the offline engine's, streamed and not, even when the prompt's blocks are in the prefix cache."""
    prompt = "The quick brown fox jumps over the lazy dog because it was in a hurry to get home."
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 2}
    engine = LLMEngine.from_config(EngineConfig(num_kv_blocks=64, speculative=SpecConfig(mode="off")))
    ids = engine.tokenizer.encode(prompt)
    [want] = engine.generate([ids], SamplingParams(temperature=0.0, max_tokens=3, logprobs=2, prompt_logprobs=2))
    for attempt in range(2):  # the second time, the prompt's whole blocks are cached: still every token
        choice = httpx.post(f"{disagg}/v1/completions", json=body, timeout=60).json()["choices"][0]
        assert choice["text"] == prompt + want.text
        lps = choice["logprobs"]
        assert len(lps["tokens"]) == len(ids) + 3
        assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
        expected = [x.logprob for x in want.prompt_logprobs] + [x.logprob for x in want.logprobs]
        assert lps["token_logprobs"][1:] == pytest.approx(expected, abs=1e-4)
        assert all(len(top) <= 2 for top in lps["top_logprobs"][1:])
        assert lps["text_offset"] == sorted(lps["text_offset"]) and lps["text_offset"][0] == 0
    chunks = []
    with httpx.stream("POST", f"{disagg}/v1/completions", json=body | {"stream": True}, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    streamed = {"tokens": [], "token_logprobs": []}
    for c in chunks:
        for key in streamed:
            streamed[key] += ((c["choices"][0].get("logprobs") or {}).get(key) or [])
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
    assert streamed == {key: lps[key] for key in streamed}


def test_lm_evaluation_harness_scores_equal_the_offline_engines(disagg, tmp_path, monkeypatch):
    """lm-evaluation-harness's `local-completions` model against the stack (its remote tokenizer is
    our /tokenize + /tokenizer_info): a log-likelihood task (echo + logprobs) and a generative one,
    both over local files; every per-sample result and both scores equal the offline engine's."""
    import lm_eval  # a dev dependency (lm-eval[api]): imported here, as it takes seconds
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    data = Path(__file__).parents[1] / "data" / "lmeval"
    for name in ("pdserve_capitals.yaml", "pdserve_arithmetic.yaml"):  # the data files by absolute path
        text = (data / name).read_text().replace("test: ", f"test: {data}/")
        (tmp_path / name).write_text(text)
    results = lm_eval.simple_evaluate(
        model="local-completions", tasks=["pdserve_capitals", "pdserve_arithmetic"],
        model_args=f"base_url={disagg}/v1/completions,model={MODEL},tokenizer_backend=remote,num_concurrent=2",
        task_manager=TaskManager(include_path=str(tmp_path)), log_samples=True)

    engine = LLMEngine.from_config(EngineConfig(num_kv_blocks=64, speculative=SpecConfig(mode="off")))
    tok = engine.tokenizer
    encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731  (what /tokenize gives)
    correct = []
    for sample in sorted(results["samples"]["pdserve_capitals"], key=lambda s: s["doc_id"]):
        doc = sample["doc"]
        context = f"Question: What is the capital of {doc['country']}?\nAnswer:"
        lls = []
        for choice, (ll, greedy) in zip(doc["choices"], sample["filtered_resps"]):
            context_ids = encode(context)  # lm-eval's pair encoding: the whole, then split at the context
            whole = encode(context + " " + choice)
            [out] = engine.generate([whole], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1))
            mine = out.prompt_logprobs[len(context_ids) - 1:]
            assert ll == pytest.approx(sum(x.logprob for x in mine), abs=1e-3), (doc, choice)
            assert greedy == all(x.top_ids[0] == t for x, t in zip(mine, whole[len(context_ids):]))
            lls.append(ll)
        correct.append(max(range(len(lls)), key=lls.__getitem__) == doc["label"])
    assert results["results"]["pdserve_capitals"]["acc,none"] == pytest.approx(sum(correct) / len(correct))
    assert 0 < sum(correct)  # the model knows some capitals: the scores are not noise

    norm = lambda text: text.lower().translate(str.maketrans("", "", string.punctuation))  # noqa: E731
    matches = []
    for sample in results["samples"]["pdserve_arithmetic"]:
        doc = sample["doc"]
        [out] = engine.generate([encode(doc["question"])], SamplingParams(temperature=0.0, max_tokens=8, stop=["\n"]))
        assert sample["filtered_resps"][0] == out.text
        matches.append(norm(out.text) == norm(doc["answer"]))
    assert results["results"]["pdserve_arithmetic"]["exact_match,none"] == pytest.approx(sum(matches) / len(matches))


def test_prefix_reuse_reports_cached_tokens(disagg):
    document = " ".join(f"Fact {i}: the number {i} squared is {i * i}." for i in range(60))  # ~900 tokens
    first = chat(disagg, document + "\nWhat is fact 3?", max_tokens=8)
    second = chat(disagg, document + "\nWhat is fact 7?", max_tokens=8)
    # only the chat template's system-prompt head can be cached from earlier requests
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] <= 32
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 800 and cached % 16 == 0
    # the services' counters reach the gateway's /metrics with their next published stats
    deadline = time.monotonic() + 15
    while sum(metric_values(disagg, "pdserve_prefix_cache_hits_total").values()) * 16 < cached:
        assert time.monotonic() < deadline, metric_values(disagg, "pdserve_prefix_cache_hits_total")
        time.sleep(0.2)


def test_reset_prefix_cache_forgets_every_cached_block(disagg):
    document = " ".join(f"Note {i}: the colour of box {i} is {['red', 'blue', 'green'][i % 3]}." for i in range(30))
    chat(disagg, document + "\nWhich colour is box 4?", max_tokens=4)
    cached = chat(disagg, document + "\nWhich colour is box 5?", max_tokens=4)["usage"]["prompt_tokens_details"]
    assert cached["cached_tokens"] >= 256
    r = httpx.post(f"{disagg}/reset_prefix_cache", timeout=30)
    assert r.status_code == 200, r.text
    assert {name.split()[0] for name in r.json()["reset"]} == {"kvstore", "prefill", "decode"}
    assert len(r.json()["reset"]) == 4 and r.json()["blocks_forgotten"] >= 16
    again = chat(disagg, document + "\nWhich colour is box 6?", max_tokens=4)["usage"]["prompt_tokens_details"]
    assert again["cached_tokens"] == 0


def _prefill_prefix_counters(url: str) -> tuple[float, float]:
    rows = lambda name: sum(v for k, v in metric_values(url, name).items() if 'service="prefill"' in k)  # noqa: E731
    return rows("pdserve_prefix_cache_queries_total"), rows("pdserve_prefix_cache_hits_total")


def test_n_choices_share_one_prefill_and_are_the_offline_engines(disagg):
    """n=4 at temperature 0.8 with a seed: four distinct choices, each the offline engine's output
    for seed + i, the same when asked again; the prompt is computed once (choices 1-3 find its
    whole blocks in the prefix cache and compute only the partial last one)."""
    prompt = ("Here are notes from a gardening club meeting. " * 6) + "Write a short poem about the tomatoes."
    params = {"temperature": 0.8, "top_p": 0.95, "seed": 1234, "max_tokens": 24}
    q0, h0 = _prefill_prefix_counters(disagg)
    first = chat(disagg, prompt, n=4, **params)
    texts = [c["message"]["content"] for c in sorted(first["choices"], key=lambda c: c["index"])]
    assert len(set(texts)) == 4, texts
    for i, text in enumerate(texts):
        assert text == offline(prompt, **params | {"seed": 1234 + i}).text, i
    num_prompt = first["usage"]["prompt_tokens"]
    whole = (num_prompt - 1) // 16  # blocks a prefill looks up
    assert whole >= 4
    deadline = time.monotonic() + 15  # the prefill worker's counters come with its next published stats
    while (c := _prefill_prefix_counters(disagg)) and c[0] - q0 < 4 * whole:
        assert time.monotonic() < deadline, c
        time.sleep(0.2)
    queries, hits = c[0] - q0, c[1] - h0
    assert queries == 4 * whole and hits >= 3 * whole, (queries, hits)  # choices 1-3: every whole block cached
    again = chat(disagg, prompt, n=4, **params)
    assert [c["message"]["content"] for c in sorted(again["choices"], key=lambda c: c["index"])] == texts


def test_two_decode_workers_share_concurrent_load(disagg_stack):
    stack, disagg = disagg_stack
    results = []

    def one(i):
        results.append(chat(disagg, f"Count from {i} to {i + 5}.", max_tokens=12))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 8
    # each decode worker logs the requests it takes: both must have taken some
    taken = {i: (stack.workdir / f"decode-{i}.log").read_text().count("took request") for i in range(2)}
    assert all(n > 0 for n in taken.values()), taken


def test_cancellation_frees_every_block(disagg):
    def disconnect_midway(i):
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"Tell me a long story number {i}."}],
                "max_tokens": 400, "temperature": 0.0, "stream": True}
        with httpx.stream("POST", f"{disagg}/v1/chat/completions", json=body, timeout=60) as r:
            for n, _ in enumerate(r.iter_lines()):
                if n >= 3:
                    break  # closing the response here is the client going away

    threads = [threading.Thread(target=disconnect_midway, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        in_use = metric_values(disagg, "pdserve_kv_blocks_in_use")
        workers = {k: v for k, v in in_use.items() if 'service="gateway"' not in k}
        if workers and all(v == 0 for v in workers.values()):
            break
        time.sleep(0.5)
    assert workers and all(v == 0 for v in workers.values()), in_use
    assert {'prefill', 'decode', 'kvstore'} <= {re.search(r'service="(\w+)"', k).group(1) for k in workers}
    assert "Paris" in chat(disagg, QUESTION)["choices"][0]["message"]["content"]  # still serving


def test_bad_requests_get_clear_errors(disagg):
    cases = [
        ({"model": MODEL, "messages": []}, 400),
        ({"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}, 404),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6}, 400),
    ]
    for body, status in cases:
        r = httpx.post(f"{disagg}/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == status, (body, r.text)
        assert r.json()["error"]["message"]
    r = httpx.post(f"{disagg}/v1/chat/completions", content=b"{not json", timeout=30,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    assert httpx.get(f"{disagg}/health", timeout=10).status_code == 200


def test_other_modes_and_network_kv_give_identical_tokens(disagg, tmp_path_factory):
    """colocated; conditional (these prompts are short: decode prefills them itself); and the
    network KV data path instead of shared memory."""
    prompts = [QUESTION, "Name two planets."]
    expected = [chat(disagg, p, max_tokens=20)["choices"][0]["message"]["content"] for p in prompts]
    for extra in (("--mode", "colocated", "--decode", "1"), ("--mode", "conditional"),
                  ("--kv-network", "--prefill", "1", "--decode", "1")):
        stack, url = up(tmp_path_factory, *extra)
        try:
            got = [chat(url, p, max_tokens=20)["choices"][0]["message"]["content"] for p in prompts]
        finally:
            stack.stop()
        assert got == expected, extra
        if "conditional" in extra:  # short prompts went straight to decode, not through prefill
            assert (stack.workdir / "decode-0.log").read_text().count("tokens, whole)") == len(prompts)
