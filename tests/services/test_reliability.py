"""Reliability on the whole stack (real nats-server, valkey-server, kvstore, workers, gateway, the
real model): authentication on every link, a table of bad inputs, fuzzing, a disconnect storm,
and NATS / Valkey restarting under load. Every request must end, and no KV block may stay in use."""

from __future__ import annotations

import asyncio
import json
import random
import re
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.services.test_e2e import MODEL, up
from tests.services.test_faults import join_all, run_streams, wait_no_blocks_in_use

pytestmark = pytest.mark.slow

API_KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4}
COMPLETION = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4}


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    """A stack with every credential on: NATS user/password, a Valkey password, an API key. The
    default configuration: these tests check lifetimes and errors, not exact text."""
    stack, url = up(tmp_path_factory,
                    "--nats-user", "pd", "--nats-password", "nats-secret", "--redis-password", "valkey-secret",
                    "--api-key", API_KEY, "--gateway-arg=--default-max-tokens=8")
    yield stack, url
    stack.stop()


def healthy_and_serving(url: str) -> None:
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    r = httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4


# ----------------------------------------------------------------------------------- credentials


async def test_nats_and_valkey_refuse_clients_without_credentials(secured):
    import nats
    import redis.asyncio as aioredis
    from nats.errors import NoServersError
    from redis.exceptions import AuthenticationError, ResponseError

    stack, url = secured
    nats_server, valkey_server = stack.servers
    with pytest.raises((NoServersError, nats.errors.Error, OSError)):
        await nats.connect(nats_server.url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2)
    nc = await nats.connect(nats_server.url, user="pd", password="nats-secret", allow_reconnect=False)
    await nc.close()
    r = aioredis.from_url(valkey_server.url)
    with pytest.raises((AuthenticationError, ResponseError)):
        await r.ping()
    await r.aclose()
    healthy_and_serving(url)  # and the services, given the credentials by `pdserve up`, work


# ------------------------------------------------------------------------------------ bad inputs

LONG_PROMPT = "word " * 9000  # > the 8,192-token context

# (case, method, path, body: dict | bytes | None, headers, expected status, a word the error message names)
BAD_INPUTS = [
    ("no api key", "POST", "/v1/chat/completions", CHAT, {"Authorization": ""}, 401, "API key"),
    ("wrong api key", "POST", "/v1/chat/completions", CHAT, {"Authorization": "Bearer nope"}, 401, "API key"),
    ("basic auth scheme", "POST", "/v1/completions", COMPLETION, {"Authorization": f"Basic {API_KEY}"}, 401, "API key"),
    ("models without key", "GET", "/v1/models", None, {"Authorization": ""}, 401, "API key"),
    ("malformed json", "POST", "/v1/chat/completions", b'{"model": "x", "messages": [', {}, 400, "JSON"),
    ("invalid utf-8", "POST", "/v1/completions", b'{"model": "m", "prompt": "\xff\xfe\xfa"}', {}, 400, ""),
    ("stream_options without stream", "POST", "/v1/chat/completions",
     {**CHAT, "stream_options": {"include_usage": True}}, {}, 400, "stream"),
    ("json null body", "POST", "/v1/completions", b"null", {}, 400, "object"),
    ("body is a string", "POST", "/v1/chat/completions", b'"hello"', {}, 400, "object"),
    ("empty body", "POST", "/v1/chat/completions", b"", {}, 400, ""),
    ("form content type", "POST", "/v1/completions", b"prompt=hi", {"content-type": "application/x-www-form-urlencoded"},
     415, "application/json"),
    ("body over the size limit", "POST", "/v1/completions", b'{"prompt": "' + b"a" * (5 << 20) + b'"}', {}, 413,
     "limit"),
    ("prompt longer than the context", "POST", "/v1/completions", {**COMPLETION, "prompt": LONG_PROMPT}, {}, 400,
     "context"),
    ("max_tokens beyond the context", "POST", "/v1/completions", {**COMPLETION, "max_tokens": 10**6}, {}, 400,
     "max_tokens"),
    ("max_tokens huge integer", "POST", "/v1/completions", {**COMPLETION, "max_tokens": 10**30}, {}, 400,
     "max_tokens"),
    ("max_tokens negative", "POST", "/v1/chat/completions", {**CHAT, "max_tokens": -1}, {}, 400, "max_tokens"),
    ("max_tokens as string", "POST", "/v1/chat/completions", {**CHAT, "max_tokens": "4"}, {}, 400, "max_tokens"),
    ("temperature NaN literal", "POST", "/v1/completions", b'{"prompt": "a", "temperature": NaN}', {}, 400, "JSON"),
    ("temperature 1e309", "POST", "/v1/completions", b'{"prompt": "a", "temperature": 1e309}', {}, 400, ""),
    ("top_p above 1", "POST", "/v1/completions", {**COMPLETION, "top_p": 1.01}, {}, 400, "top_p"),
    ("top_k as list", "POST", "/v1/completions", {**COMPLETION, "top_k": [1]}, {}, 400, "top_k"),
    ("seed as float", "POST", "/v1/completions", {**COMPLETION, "seed": 1.5}, {}, 400, "seed"),
    ("stream as string", "POST", "/v1/chat/completions", {**CHAT, "stream": "true"}, {}, 400, "stream"),
    ("messages empty", "POST", "/v1/chat/completions", {**CHAT, "messages": []}, {}, 400, "messages"),
    ("message without role", "POST", "/v1/chat/completions", {**CHAT, "messages": [{"content": "hi"}]}, {}, 400,
     "role"),
    ("message content a number", "POST", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": 12}]}, {}, 400, "content"),
    ("prompt token id negative", "POST", "/v1/completions", {**COMPLETION, "prompt": [1, -3]}, {}, 400, ""),
    ("prompt token id outside vocab", "POST", "/v1/completions", {**COMPLETION, "prompt": [10**9]}, {}, 400,
     "vocabulary"),
    ("prompt a dict", "POST", "/v1/completions", {**COMPLETION, "prompt": {"text": "hi"}}, {}, 400, "prompt"),
    ("stop too many", "POST", "/v1/completions", {**COMPLETION, "stop": list("abcdefg")}, {}, 400, "stop"),
    ("unknown model", "POST", "/v1/completions", {**COMPLETION, "model": "llama-70b"}, {}, 404, "llama-70b"),
    ("n above the limit", "POST", "/v1/chat/completions", {**CHAT, "n": 17}, {}, 400, "n"),
    ("best_of below n", "POST", "/v1/completions", {**COMPLETION, "n": 3, "best_of": 2}, {}, 400, "best_of"),
    ("best_of streamed", "POST", "/v1/completions", {**COMPLETION, "n": 1, "best_of": 2, "stream": True}, {}, 400,
     "best_of"),
    ("json schema that does not compile", "POST", "/v1/chat/completions",
     {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}}},
     {}, 400, "strnig"),
    ("unknown response_format type", "POST", "/v1/chat/completions", {**CHAT, "response_format": {"type": "yaml"}},
     {}, 400, "response_format"),
    ("two structured outputs", "POST", "/v1/completions",
     {**COMPLETION, "guided_regex": "a+", "guided_choice": ["a", "b"]}, {}, 400, "at most one"),
    ("regex that does not compile", "POST", "/v1/completions", {**COMPLETION, "guided_regex": "a(b"}, {}, 400,
     "guided_regex"),
    ("guided_choice empty", "POST", "/v1/completions", {**COMPLETION, "guided_choice": []}, {}, 400,
     "guided_choice"),
    ("unknown route", "POST", "/v1/embeddings", COMPLETION, {}, 404, ""),
    ("wrong method", "GET", "/v1/chat/completions", None, {}, 405, ""),
]


def send(url: str, method: str, path: str, body, headers: dict) -> httpx.Response:
    headers = {**AUTH, **headers}
    if not headers.get("Authorization"):
        headers.pop("Authorization")
    if isinstance(body, bytes):
        headers.setdefault("content-type", "application/json")
        return httpx.request(method, f"{url}{path}", content=body, headers=headers, timeout=30)
    return httpx.request(method, f"{url}{path}", json=body, headers=headers, timeout=30)


def test_bad_inputs_get_the_right_4xx_with_an_error_body(secured):
    _, url = secured
    assert len(BAD_INPUTS) >= 25
    failures = []
    for case, method, path, body, headers, status, needle in BAD_INPUTS:
        r = send(url, method, path, body, headers)
        try:
            error = r.json()["error"]
            ok = (r.status_code == status and isinstance(error["message"], str) and error["message"]
                  and needle.lower() in error["message"].lower() and error.get("type"))
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            failures.append(f"{case}: {r.status_code} {r.text[:200]!r}")
    assert not failures, "\n".join(failures)
    healthy_and_serving(url)
    unknown_fields = send(url, "POST", "/v1/chat/completions", {**CHAT, "frobnicate": 3}, {})
    assert unknown_fields.status_code == 200  # like OpenAI and vLLM: unknown fields are ignored


# ---------------------------------------------------------------------------------------- fuzzing

_scalars = st.one_of(st.none(), st.booleans(), st.integers(-10, 16), st.integers(-(10**20), 10**20),
                     st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=40))
_values = st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(st.text(max_size=10), inner, max_size=4)),
                       max_leaves=8)
_fields = ("model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
           "stream_options", "n", "min_tokens", "ignore_eos", "max_completion_tokens", "user")


@st.composite
def fuzzed_request(draw):
    """A valid request with some fields replaced by arbitrary JSON, some dropped, some added."""
    path = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    body = dict(COMPLETION if path == "/v1/completions" else CHAT)
    for field in draw(st.lists(st.sampled_from(_fields), max_size=4, unique=True)):
        if draw(st.booleans()):
            body[field] = draw(_values)
        else:
            body.pop(field, None)
    if draw(st.integers(0, 9)) == 0:
        body[draw(st.text(max_size=12))] = draw(_values)
    # generation length stays small whatever the fuzz picked (the gateway's default is 8 here)
    if isinstance(body.get("max_tokens"), int) and 16 < body["max_tokens"] < 10**5:
        body["max_tokens"] = 16
    return path, body


def test_fuzzed_requests_never_get_a_5xx(secured):
    _, url = secured
    seen: dict[int, int] = {}
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as client:

        @settings(max_examples=150, deadline=None, derandomize=True,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
        @given(fuzzed_request())
        def check(request):
            path, body = request
            r = client.post(path, json=body)
            seen[r.status_code] = seen.get(r.status_code, 0) + 1
            assert r.status_code < 500, (body, r.status_code, r.text[:300])
            if r.status_code >= 400:
                assert r.json()["error"]["message"], r.text
            elif body.get("stream") is True:
                assert r.text.rstrip().endswith("data: [DONE]"), r.text[-300:]

        check()
    print(f"fuzz: status codes {dict(sorted(seen.items()))}")
    assert seen.get(200, 0) > 0 and sum(v for k, v in seen.items() if 400 <= k < 500) > 0
    healthy_and_serving(url)


# ------------------------------------------------------------------------------- disconnect storm


async def test_disconnect_storm_leaves_no_block_in_use(secured):
    """50 streams (short chats and ~700-token documents, two prefill chunks each), half cut by the
    client at a random moment — queued, prefilling, moving KV or decoding; the other half complete.
    Afterwards no KV block is in use in any service, and the server still answers. (The documents
    were ~2,100 tokens: on an AVX2-only 2-core host, where a prefill runs ~50 tokens/s, the nine
    that complete were 6 minutes of prefill, past the streams' 180 s.)"""
    _, url = secured
    rng = random.Random(7)
    outcome = {"completed": 0, "cut": 0, "errored": 0}
    errors = []

    async def one(client: httpx.AsyncClient, i: int) -> None:
        content = (f"Document {i}: " + " ".join(f"fact {j} about item {i}." for j in range(60))
                   if i % 3 == 0 else f"Tell me a story about the number {i}.")
        body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 24,
                "stream": True, "ignore_eos": True}
        cut_after = rng.uniform(0.05, 6.0) if i % 2 else None
        lines = []

        async def consume():
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200, await r.aread()
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        lines.append(line)

        if cut_after is None:
            await asyncio.wait_for(consume(), 180)
            # an error event is a chunk whose top level is {"error": ...} (a delta whose text is
            # `error` also contains '"error"': it once counted a completed stream as errored)
            failed = [line for line in lines[:-1] if "error" in json.loads(line[len("data: "):])]
            if lines[-1] == "data: [DONE]" and not failed:
                outcome["completed"] += 1
            else:
                outcome["errored"] += 1
                errors.append(failed or lines[-2:])
        else:
            try:
                await asyncio.wait_for(consume(), cut_after)  # the client goes away: the connection closes
                outcome["completed"] += 1  # it finished before its cut
            except TimeoutError:
                outcome["cut"] += 1

    async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=180,
                                 limits=httpx.Limits(max_connections=100)) as client:
        await asyncio.gather(*(one(client, i) for i in range(50)))
    assert outcome["errored"] == 0 and outcome["completed"] + outcome["cut"] == 50, (outcome, errors)
    assert outcome["cut"] >= 10, outcome
    leaks = await asyncio.to_thread(wait_no_blocks_in_use, url, 30)
    print(f"storm: {outcome}; blocks in use afterwards: {leaks}")
    await asyncio.to_thread(healthy_and_serving, url)


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_a_prefill_longer_than_the_inactivity_timeout_completes_while_the_engine_steps(tmp_path_factory, mode):
    """The gateway ends a request after --inactivity-timeout without a word from its workers, and a
    prefix-hit lease expires after --lease-ttl; a prompt that takes longer to prefill (here small
    chunks; in production a long document behind others on a slow CPU) is neither silent nor
    abandoned: each time its engine has stepped, the worker computing it (a prefill worker, or a
    colocated one) sends the gateway a notice, and a prefill worker renews its lease. The request
    completes; disaggregated, its KV went through the kvstore (not recomputed for want of a lease)."""
    stack, url = up(tmp_path_factory, "--mode", mode, "--gateway-arg=--inactivity-timeout=2",
                    "--worker-arg=--ack-wait=1.5", "--worker-arg=--lease-ttl=2",
                    "--worker-arg=--max-num-batched-tokens=8")
    try:
        warm = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=60)  # caches the template's first block
        assert warm.status_code == 200, warm.text
        content = "A long document. " + " ".join(f"Line {i}: the fox jumps over dog {i}." for i in range(130))
        body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 8,
                "temperature": 0.0, "ignore_eos": True}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        print(f"{mode}: {usage['prompt_tokens']} prompt tokens, {usage['timing_ms']}, {usage['cost']}")
        assert usage["completion_tokens"] == 8, usage
        computed_s = usage["cost"]["prefill_seconds"]
        assert computed_s > 2, usage  # longer than both the timeout and the TTL
        if mode == "disaggregated":
            assert usage["prompt_tokens_details"]["cached_tokens"] > 0, usage  # a lease was held …
            assert usage["cost"]["kv_bytes"] > 0, usage  # … and kept: the blocks were stored, and read by decode
        wait_no_blocks_in_use(url, 30)
    finally:
        stack.stop()


def stream_gaps(url: str, content: str, max_tokens: int, streaming: threading.Event | None = None,
                after: int = 10) -> tuple[dict, list[dict], float]:
    """Stream one chat request; returns (its usage, error payloads, the longest wait between two
    content chunks in seconds). Sets `streaming` after `after` content chunks."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    usage, errors, longest, last, chunks = {}, [], 0.0, None, 0
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            errors += [chunk["error"]] if "error" in chunk else []
            usage = chunk.get("usage") or usage
            if any(c["delta"].get("content") for c in chunk.get("choices", [])):
                now = time.monotonic()
                longest = max(longest, now - last) if last is not None else 0.0
                last, chunks = now, chunks + 1
                if streaming is not None and chunks == after:
                    streaming.set()
    return usage, errors, longest


def test_a_request_waiting_for_a_busy_decode_pool_waits_instead_of_timing_out(tmp_path_factory):
    """One decode worker with room for one sequence, and three long answers at once: after its first
    token, each later request waits in the decode queue longer than the gateway's inactivity timeout
    (3 s). Its prefill worker tells the gateway the request is queued, so the gateway waits its queue
    timeout, as for a job no prefill worker has taken yet (it ended such a request with "no tokens
    from the workers"); and the decode worker takes a job only with room for it, counting the one it
    took a moment ago that its engine has not added yet (it took a second job at once, and that one
    sat in its engine, silent). Every request completes."""
    # an ack wait of 6 s: a worker computing a prompt tells the gateway so every 2 s (each third of it),
    # within the 3-s timeout (a 36-token prompt beside another test's processes once took 3 s)
    stack, url = up(tmp_path_factory, "--prefill", "1", "--decode", "1", "--worker-arg=--max-num-seqs=1",
                    "--worker-arg=--ack-wait=6", "--gateway-arg=--inactivity-timeout=3")
    try:
        for _ in range(3):  # the workers' first steps (cold, beside other tests) can be slower than 3 s
            warm = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=60)
            if warm.status_code == 200:
                break
        assert warm.status_code == 200, warm.text
        results: dict[int, tuple] = {}
        def one(i: int) -> None:
            results[i] = stream_gaps(url, f"Tell me story {i}.", 400)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
            time.sleep(0.2)
        join_all(threads, 300)
        print(f"\n(usage, errors, longest wait in s) per request: {results}")
        assert all(errors == [] and usage["completion_tokens"] == 400 for usage, errors, _ in results.values()), results
        # the later requests' waits in the decode queue, as the decode worker timed them
        assert max(usage["timing_ms"]["decode_queue"] for usage, _, _ in results.values()) > 3000, results
        assert max(longest for _, _, longest in results.values()) > 3 + 1, results  # it did wait that long
        wait_no_blocks_in_use(url, 30)
    finally:
        stack.stop()


def first_answer_streaming(url: str, results: dict, content: str, max_tokens: int) -> threading.Thread:
    """Stream `content`'s answer in a thread into results["first"]; returns the thread once the
    answer is streaming."""
    streaming = threading.Event()
    first = threading.Thread(target=lambda: results.__setitem__("first", stream_gaps(url, content, max_tokens,
                                                                                       streaming)))
    first.start()
    assert streaming.wait(120), results
    return first


def doc(i: int, lines: int) -> str:
    return f"Document {i}. " + " ".join(f"Line {k}: the fox {i} jumps over dog {k * i}." for k in range(lines))


def test_a_decode_job_whose_prompt_does_not_fit_yet_waits_for_room(tmp_path_factory):
    """A decode worker with a 64-block KV cache is decoding a 650-token document (41 blocks, growing
    to 57) when a 500-token one (32 blocks) is handed to it. It puts the job back in the decode
    queue for a worker with room; none has, it gets the job back, and now waits for the first one's
    blocks to be freed (taking no other job, the job's blocks still in the store), then reads them
    and decodes it. It used to fail it at once: "no room for 32 KV blocks" (503)."""
    stack, url = up(tmp_path_factory, "--prefill", "1", "--decode", "1", "--worker-arg=--num-kv-blocks=64")
    try:
        results: dict[str, tuple] = {}
        first = first_answer_streaming(url, results, doc(1, 40), 250)
        results["second"] = stream_gaps(url, doc(2, 30), 20)
        join_all([first], 120)
        print(f"\n(usage, errors, longest wait in s): {results}")
        (first_usage, first_errors, _), (second_usage, second_errors, _) = results["first"], results["second"]
        assert first_errors == [] and second_errors == [], results
        assert first_usage["completion_tokens"] == 250 and second_usage["completion_tokens"] == 20, results
        log = (stack.workdir / "decode-0.log").read_text()
        handed = re.search(r"request (\S+) needs 3\d KV blocks \(\d+ free\): handed back", log)
        assert handed, log[-2000:]
        assert re.search(rf"request {handed[1]} waits for 3\d KV blocks \(\d+ free\)", log), log[-2000:]
        wait_no_blocks_in_use(url, 30)
    finally:
        stack.stop()


def test_a_decode_job_waiting_for_room_goes_to_a_decode_worker_that_has_it_first(tmp_path_factory):
    """One decode worker with 160 KV blocks decodes a long answer (growing to ~150 blocks); a document
    of 96 blocks comes when ~85 are taken. The worker hands it back, gets it back (no other worker)
    and waits with it, its blocks still in the store. A second decode worker starts (as the autoscaler
    would add one): its stats show room, so the waiting worker hands the job on once more, and the
    new worker decodes it while the long answer still runs (the job waited for the answer's end
    before). Its KV lease lasts 6 s, less than the wait (the second worker starts 7 s into it): the
    waiting worker renews it."""
    from services.up import StackWorkers

    stack, url = up(tmp_path_factory, "--prefill", "1", "--decode", "1", "--worker-arg=--num-kv-blocks=160",
                    "--worker-arg=--speculative=off", "--worker-arg=--lease-ttl=6")
    try:
        results: dict[str, tuple] = {}
        streaming, done = threading.Event(), threading.Event()

        def long_answer() -> None:
            try:
                results["long"] = stream_gaps(url, "Write a long story about a fox and a dog.", 2400, streaming,
                                              after=1000)
            finally:
                done.set()

        first = threading.Thread(target=long_answer)
        first.start()
        assert streaming.wait(180), results  # ~1,000 tokens out: ~65 blocks taken
        second = threading.Thread(target=lambda: results.__setitem__("doc", stream_gaps(url, doc(1, 95), 8)))
        second.start()
        log0 = stack.workdir / "decode-0.log"
        deadline = time.monotonic() + 60
        while not re.search(r"waits for \d+ KV blocks \(\d+ free\), its blocks in the store", log0.read_text()):
            assert time.monotonic() < deadline and not done.is_set(), log0.read_text()[-2000:]
            time.sleep(0.1)
        time.sleep(7)  # longer than the lease
        StackWorkers(stack).spawn("decode")
        join_all([second], 120)
        doc_done_while_long_ran = not done.is_set()
        join_all([first], 180)
        print(f"\n(usage, errors, longest wait in s): {results}")
        assert all(errors == [] and usage["completion_tokens"] == (2400 if name == "long" else 8)
                   for name, (usage, errors, _) in results.items()), results
        assert re.search(r"waited for \d+ KV blocks; decode-1 has room: handed back", log0.read_text()), \
            log0.read_text()[-2000:]
        log1 = (stack.workdir / "decode-1.log").read_text()
        assert "took request" in log1, log1[-2000:]
        assert "not renewed" not in log0.read_text() and "not released" not in log1  # the lease lived to the read
        assert results["doc"][0]["cost"]["kv_bytes"] > 0  # its blocks were read, not computed again
        assert doc_done_while_long_ran, "the document waited for the long answer's end"
        wait_no_blocks_in_use(url, 30)
    finally:
        stack.stop()


def test_a_decode_job_waiting_on_a_worker_that_is_stopped_goes_to_another_at_once(tmp_path_factory):
    """A decode worker with a 64-block KV cache decodes a 650-token document's answer; a second
    document's job (32 blocks) comes back to it and waits for room. The worker is stopped (SIGTERM,
    as the autoscaler removes one) and a new one started: the waiting job goes back to the decode
    queue at once, and the new worker decodes it from its blocks in the store; the stopped worker
    finishes its running answer and exits without waiting for the job. With a 30-s ack wait, a job
    that was only abandoned (as before) came back 20-30 s later, and the drain held the worker its
    whole grace period."""
    from services.up import StackWorkers

    # no drafts: the answer takes a step a token, so it still runs when the document's job has come
    # back and waits (with them its 250 tokens took ~2 s, the document's prefill ~1.3 s)
    stack, url = up(tmp_path_factory, "--prefill", "1", "--decode", "1", "--worker-arg=--num-kv-blocks=64",
                    "--worker-arg=--ack-wait=30", "--worker-arg=--speculative=off")
    try:
        results: dict[str, tuple] = {}
        first = first_answer_streaming(url, results, doc(1, 40), 250)
        ended: dict[str, float] = {}

        def second_document() -> None:
            results["second"] = stream_gaps(url, doc(2, 30), 20)
            ended["second"] = time.monotonic()

        second = threading.Thread(target=second_document)
        second.start()
        log0 = stack.workdir / "decode-0.log"
        deadline = time.monotonic() + 60
        while not re.search(r"waits for \d+ KV blocks \(\d+ free\), its blocks in the store", log0.read_text()):
            assert time.monotonic() < deadline and first.is_alive(), log0.read_text()[-2000:]
            time.sleep(0.05)
        workers = StackWorkers(stack)
        stopped = time.monotonic()
        workers.drain("decode", "decode-0")
        workers.spawn("decode")
        join_all([first, second], 120)
        print(f"\n(usage, errors, longest wait in s): {results}\nthe document ended {ended['second'] - stopped:.2f} s "
              f"after the stop")
        assert all(errors == [] for _, errors, _ in results.values()), results
        assert results["first"][0]["completion_tokens"] == 250 and results["second"][0]["completion_tokens"] == 20
        assert "grace period over" not in log0.read_text(), log0.read_text()[-2000:]  # it waited for the job
        log1 = (stack.workdir / "decode-1.log").read_text()
        assert "took request" in log1, log1[-2000:]
        assert results["second"][0]["cost"]["kv_bytes"] > 0  # its blocks were read, not computed again
        # a new worker starts in ~3 s here; the job abandoned to its ack wait came 20-30 s after the stop
        assert ended["second"] - stopped < 15, f"the document ended {ended['second'] - stopped:.1f} s after the stop"
        assert "this worker stops; back to the decode queue" in log0.read_text(), log0.read_text()[-2000:]
        wait_no_blocks_in_use(url, 30)
    finally:
        stack.stop()


def test_a_decode_job_that_does_not_fit_beside_a_running_request_goes_to_a_worker_with_room(tmp_path_factory):
    """Two decode workers with a 48-block KV cache each. One decodes a long answer to a short prompt
    (its blocks grow to ~43); meanwhile 650-token documents (41 blocks each) arrive one after the
    other. The busy worker has no room for one; the idle worker has. A worker that pulls one it has
    no room for hands it back to the decode queue, and the idle one takes it: no document waits. (The
    pull cannot see a job's size. The busy worker kept what it pulled and waited until its own request
    ended while the other worker stood idle: with the hand-back taken out, in 4 runs of 4.)"""
    # no drafts: the long answer takes a step a token (its story, learnt by the suffix cache, came
    # out so fast that it could end before the first document came)
    stack, url = up(tmp_path_factory, "--prefill", "1", "--decode", "2", "--worker-arg=--num-kv-blocks=48",
                    "--worker-arg=--speculative=off")
    try:
        results: dict[str, tuple] = {}
        streaming, done = threading.Event(), threading.Event()

        def long_answer() -> None:
            try:
                results["long"] = stream_gaps(url, "Write a long story about a fox and a dog.", 640, streaming)
            finally:
                done.set()

        first = threading.Thread(target=long_answer)
        first.start()
        assert streaming.wait(120), results
        sent_beside = 0
        for i in range(3):
            beside = not done.is_set()
            results[f"doc {i}"] = stream_gaps(url, doc(i + 1, 40), 8)
            sent_beside += beside and not done.is_set()  # it was prefilled and decoded while the long one ran
        join_all([first], 120)
        print(f"\n(usage, errors, longest wait in s): {results}")
        assert all(errors == [] and usage["completion_tokens"] == (640 if name == "long" else 8)
                   for name, (usage, errors, _) in results.items()), results
        logs = "\n".join((stack.workdir / f"decode-{i}.log").read_text() for i in range(2))
        assert not re.search(r"waits for \d+ KV blocks", logs), logs  # a document waited for the long answer
        assert sent_beside >= 1, "the long answer ended before a document came: nothing was tested"
        print(f"documents beside the long answer: {sent_beside}; handed back: "
              f"{len(re.findall(r'handed back to the decode queue', logs))}")
        wait_no_blocks_in_use(url, 30)
    finally:
        stack.stop()


# -------------------------------------------------------------------------- infrastructure restarts


def _count(results: dict) -> tuple[int, int]:
    completed = sum(1 for text, errors, _ in results.values() if not errors and text)
    errored = sum(1 for _, errors, _ in results.values() if errors)
    return completed, errored


def _wait_serving(url: str, timeout: float) -> float:
    """Seconds until /health is green and a request succeeds."""
    t0 = time.monotonic()
    while True:
        try:
            r = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=30)
            if r.status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        assert time.monotonic() - t0 < timeout, "not serving again after the restart"
        time.sleep(0.5)


def test_nats_restart_mid_load_nothing_hangs_and_service_resumes(tmp_path_factory):
    """NATS goes away for 3 s while 8 streams decode and more requests arrive: every request
    ends (completed, or an error event) within its bounds; the services reconnect by themselves;
    new requests succeed; no block stays in use."""
    stack, url = up(tmp_path_factory,
                    "--gateway-arg=--inactivity-timeout=15", "--worker-arg=--lease-ttl=10")
    try:
        nats_server = stack.servers[0]
        prompts = [f"Write a long letter to friend number {i}." for i in range(8)]
        results, threads = run_streams(url, prompts, 96)
        time.sleep(2.0)
        nats_server.stop()
        late, late_threads = {}, []
        for i in range(3):  # requests arriving while NATS is down
            t = threading.Thread(target=lambda i=i: late.__setitem__(i, _post_status(url)))
            t.start()
            late_threads.append(t)
        time.sleep(3.0)
        nats_server.start()
        t_back = time.monotonic()
        join_all(threads + late_threads, 60)
        completed, errored = _count(results)
        assert completed + errored == len(prompts)
        assert all(status in (200, 503) for status in late.values()), late
        resume_s = _wait_serving(url, 60)
        leaks = wait_no_blocks_in_use(url, 30)
        print(f"NATS restart: streams {completed} completed / {errored} errored / 0 hung; arrivals during the "
              f"outage answered {sorted(late.values())}; serving again {time.monotonic() - t_back - resume_s:.1f}+"
              f"{resume_s:.1f} s after NATS came back; blocks in use afterwards {leaks}")
    finally:
        stack.stop()


def _post_status(url: str) -> int:
    try:
        return httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=60).status_code
    except httpx.HTTPError as exc:
        return repr(exc)


def test_valkey_flushed_then_restarted_mid_load(tmp_path_factory):
    """Valkey is a hint store: FLUSHALL and then a restart (empty) while 8 streams decode — every
    stream completes, the registry refills from heartbeats, new requests succeed."""
    import redis

    stack, url = up(tmp_path_factory)
    try:
        valkey_server = stack.servers[1]
        prompts = [f"Write a poem about river number {i}." for i in range(8)]
        results, threads = run_streams(url, prompts, 64)
        time.sleep(1.5)
        redis.Redis.from_url(valkey_server.url).flushall()
        time.sleep(1.0)
        valkey_server.stop()
        time.sleep(2.0)
        valkey_server.start()
        join_all(threads, 120)
        completed, errored = _count(results)
        assert (completed, errored) == (len(prompts), 0), results
        _wait_serving(url, 30)
        deadline = time.monotonic() + 15
        while not redis.Redis.from_url(valkey_server.url).keys("pd:worker:*") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert redis.Redis.from_url(valkey_server.url).keys("pd:worker:*"), "the registry did not refill"
        wait_no_blocks_in_use(url, 30)
    finally:
        stack.stop()


def test_valkey_primary_killed_the_replica_takes_over_and_services_follow(tmp_path_factory):
    """`pdserve up --valkey-ha` (a primary, a replica, 3 sentinels; every service given the
    sentinels): SIGKILL the primary while 8 streams decode — the replica is promoted, every stream
    completes, the registry and the routing index's snapshots are written to the new primary (the
    services followed it), and new requests are served."""
    import redis

    stack, url = up(tmp_path_factory, "--valkey-ha")
    try:
        primary, replica = (next(s for s in stack.servers if s.name == name) for name in ("valkey-0", "valkey-1"))
        promoted = redis.Redis(port=replica.port)
        prompts = [f"Write a poem about mountain number {i}." for i in range(8)]
        results, threads = run_streams(url, prompts, 64)
        time.sleep(1.5)
        primary.proc.kill()
        killed_at = time.monotonic()
        join_all(threads, 120)
        completed, errored = _count(results)
        assert (completed, errored) == (len(prompts), 0), results
        deadline = time.monotonic() + 30
        while promoted.info("replication")["role"] != "master":
            assert time.monotonic() < deadline, "the sentinels did not promote the replica"
            time.sleep(0.2)
        promoted_s = time.monotonic() - killed_at
        # what the services write from now on lands on the new primary: heartbeats refresh the
        # registry's keys, cache locations re-write their snapshots
        # (the promoted replica may hold none of them: the registry's keys lapse during a slow failover)
        stale = promoted.keys("pd:worker:*") + promoted.keys("pd:cache:*")
        if stale:  # DEL without a key is an error
            promoted.delete(*stale)
        while not (promoted.keys("pd:worker:*") and promoted.keys("pd:cache:*")):
            assert time.monotonic() < deadline, "the services do not write to the promoted replica"
            time.sleep(0.2)
        serving_s = _wait_serving(url, 30)
        print(f"\nValkey primary killed: replica promoted within {promoted_s:.1f} s; 8/8 streams completed; "
              f"registry refilled on the new primary; serving ({serving_s:.1f} s)")
        wait_no_blocks_in_use(url, 30)
    finally:
        stack.stop()
