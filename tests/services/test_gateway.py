"""The gateway against real nats-server + Valkey, served by a real uvicorn (in a thread), with the real
tokenizer — and a scripted protocol peer standing in for the prefill/decode workers: it pulls
PrefillJobs from the work queues and answers with real TokenEvents for a fixed text, heartbeats like
a worker, and records every Cancel it sees.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import re
import threading
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import httpx
import openai
import pytest
from nats.js.errors import NotFoundError
from prometheus_client.parser import text_string_to_metric_families

from services.gateway.config import GatewayConfig
from services.gateway.cost import Price
from shared.telemetry.names import CONTRACT_NAMES
from services.gateway.output import OutputText
from services.gateway.server import serve
from shared.model.chat_template import render_chat
from shared.model.detokenizer import IncrementalDetokenizer
from shared.model.tokenizer import Tokenizer
from shared.protocol import subjects
from shared.protocol.messages import (Cancel, ErrorCode, PrefillJob, ResetReply, TokenEvent, Timing, Usage, WorkerStats, decode,
                                      encode)
from shared.transport import nats_bus, valkey
from shared.transport.servers import free_port, wait_for_port

ANSWER = " Paris is the capital of France."
CACHED_TOKENS = 7
CONTEXT = 8192  # SmolLM2-135M-Instruct's context length


# ------------------------------------------------------------------------------ the scripted peer


class ScriptedPeer:
    """Plays prefill + decode workers at the protocol level.

    behavior: "normal" | "duplicate" (every event twice, plus overlapping ones) | "stall" (2 tokens,
    then silence) | "gap" (skips token 2) | "error" (error event after `error_at` tokens) |
    "ignore_stop" (does not apply stop strings: the gateway alone must cut) | "handoff" (token 1 from
    the prefill worker, which says the request is queued for decode; `handoff_s` later the decode
    worker takes it) | "late_handoff" (the decode worker's "taken" notice comes before the prefill
    worker's "queued" one, then silence) | "decode_waits" (the decode worker takes it at once, says
    it is queued there — waiting for room in its KV cache — and goes on `handoff_s` later).
    """

    def __init__(self, nats_url: str, redis_url: str, tokenizer: Tokenizer, roles=("prefill", "decode")) -> None:
        self.nats_url = nats_url
        self.redis_url = redis_url
        self.tokenizer = tokenizer
        self.roles = roles
        self.behavior = "normal"
        self.error_code = ErrorCode.INTERNAL
        self.error_at = 2
        self._stopping = False
        self.paused = False  # True: take no jobs (they wait in their queues)
        self.token_delay = 0.004
        self.handoff_s = 0.0
        self.silent: set[str] = set()  # roles whose heartbeats stop (that pool is gone)
        self.answer_ids = tokenizer.encode(ANSWER, add_special_tokens=False)
        self.jobs: dict[str, tuple[str, PrefillJob]] = {}
        self.resets = 0
        self.cancels: dict[str, Cancel] = {}
        self._cancelled: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> ScriptedPeer:
        self.nc = await nats_bus.connect(self.nats_url, "scripted-peer")
        self.js = self.nc.jetstream()
        await nats_bus.ensure_streams(self.js)
        for stream, durable in ((subjects.PREFILL_STREAM, "prefill"), (subjects.DECODE_STREAM, "decode-direct")):
            await self.js.purge_stream(stream)  # jobs left over by earlier tests
            with contextlib.suppress(NotFoundError):  # left by a peer that did not stop cleanly
                await self.js.delete_consumer(stream, durable)
        self.redis = valkey.connect(self.redis_url)
        await self.nc.subscribe(subjects.CANCEL_ALL, cb=self._on_cancel)
        await self.nc.subscribe(subjects.RESET_PREFIX_CACHE, cb=self._on_reset)
        prefill = await nats_bus.pull_subscription(self.js, subjects.PREFILL_STREAM, "prefill", subjects.PREFILL_JOBS)
        direct = await nats_bus.pull_subscription(self.js, subjects.DECODE_STREAM, "decode-direct",
                                                  subjects.DECODE_DIRECT)
        subs = [prefill, direct]
        for stream, base, role in self._own_queues():  # the router sends jobs to a chosen worker's own subject
            subs.append(await nats_bus.worker_subscription(self.js, stream, base, f"peer-{role}", ack_wait=30,
                                                           max_deliver=3))
        await self._heartbeat()
        await self.nc.flush()
        self._spawn(self._heartbeat_loop())
        for sub in subs:
            self._spawn(self._fetch_loop(sub))
        return self

    def _own_queues(self) -> list[tuple[str, str, str]]:
        return [(subjects.DECODE_STREAM, subjects.DECODE_DIRECT, role) if role == "decode" else
                (subjects.PREFILL_STREAM, subjects.PREFILL_JOBS, role) for role in self.roles]

    async def stop(self) -> None:
        self._stopping = True  # nats' fetch may turn a cancellation into a TimeoutError: loops check this too
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            _, pending = await asyncio.wait(list(self._tasks), timeout=5)
            assert not pending, f"peer tasks ignore cancellation: {pending}"
        await self.redis.delete(*(subjects.registry_key(role, f"peer-{role}") for role in self.roles))
        await self.redis.aclose()
        for stream, durable in ((subjects.PREFILL_STREAM, "prefill"), (subjects.DECODE_STREAM, "decode-direct")):
            await self.js.delete_consumer(stream, durable)
        for stream, base, role in self._own_queues():
            with contextlib.suppress(NotFoundError):
                await self.js.delete_consumer(stream, f"{base.replace('.', '-')}-peer-{role}")
        await self.nc.close()

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def wait_cancel(self, request_id: str, timeout: float = 5.0) -> Cancel:
        await asyncio.wait_for(self._cancelled[request_id].wait(), timeout)
        return self.cancels[request_id]

    async def _on_cancel(self, msg) -> None:
        cancel = decode(msg.data, Cancel)
        assert msg.subject == subjects.cancel(cancel.request_id)
        self.cancels[cancel.request_id] = cancel
        self._cancelled[cancel.request_id].set()

    async def _on_reset(self, msg) -> None:
        self.resets += 1
        for role in self.roles:  # as each of its workers would answer
            await self.nc.publish(msg.reply, encode(ResetReply(role=role, instance=f"peer-{role}", blocks=3)))

    # -- worker-like heartbeat: registry keys in Valkey + WorkerStats on pd.stats.<role>.<inst>

    def stats(self, role: str) -> WorkerStats:
        return WorkerStats(role=role, instance=f"peer-{role}", running=1, waiting=2, kv_blocks_total=100,
                           kv_blocks_in_use=5 if role == "decode" else 3, prefix_queries=40, prefix_hits=30,
                           free_slots=8, ts=time.time())

    async def _heartbeat(self) -> None:
        for role in self.roles:
            if role in self.silent:
                continue
            stats = self.stats(role)
            await self.redis.set(subjects.registry_key(role, stats.instance), encode(stats), ex=5)
            await self.nc.publish(subjects.stats(role, stats.instance), encode(stats))

    async def _heartbeat_loop(self) -> None:
        while not self._stopping:
            await asyncio.sleep(0.5)
            await self._heartbeat()

    # -- jobs

    async def _fetch_loop(self, psub) -> None:
        while not self._stopping:
            if self.paused:
                await asyncio.sleep(0.05)
                continue
            try:
                msgs = await psub.fetch(batch=8, timeout=0.5)
            except TimeoutError:  # nats' own TimeoutError, or asyncio's when the client side expires
                continue
            for msg in msgs:
                await msg.ack()
                job = decode(msg.data, PrefillJob)
                self.jobs[job.request_id] = (msg.subject, job)
                self._spawn(self._answer(job))

    def _script(self, job: PrefillJob) -> tuple[list[int], str, str | None]:
        """The tokens a real engine would emit for ANSWER under the job's max_tokens and stop strings."""
        ids = self.answer_ids[: job.params.max_tokens]
        finish = "length" if len(ids) < len(self.answer_ids) else "stop"
        if job.params.stop and self.behavior != "ignore_stop":
            detok, text = IncrementalDetokenizer(self.tokenizer, job.prompt_ids), ""
            for n, token in enumerate(ids, 1):
                text += detok.push(token)
                hit = next((s for s in job.params.stop if s in text), None)
                if hit is not None:
                    return ids[:n], "stop", hit
        return ids, finish, None

    async def _answer(self, job: PrefillJob) -> None:
        rid = job.request_id
        subject = subjects.tokens(rid)
        ids, finish, stop_reason = self._script(job)

        async def send(event: TokenEvent) -> None:
            event.attempt = job.attempt
            await self.nc.publish(subject, encode(event))

        for i, token in enumerate(ids):
            cancel = self.cancels.get(rid)
            if cancel is not None and (cancel.attempt < 0 or job.attempt <= cancel.attempt):
                return  # a worker drops a cancelled request (attempt) at its next step
            if self.behavior == "stall" and i == 2:
                return
            if self.behavior == "error" and i == self.error_at:
                await send(TokenEvent(request_id=rid, index=i, finished=True, finish_reason="error",
                                      error_code=self.error_code, error="scripted failure", worker="peer-decode"))
                return
            if self.behavior == "gap" and i == 2:
                continue
            handoff = i == 0 and self.behavior in ("handoff", "late_handoff", "decode_waits")
            event = TokenEvent(request_id=rid, index=i, token_ids=[token],
                               worker="peer-prefill" if handoff else "peer-decode")
            await send(event)
            if handoff:
                queued = TokenEvent(request_id=rid, index=1, worker="peer-prefill", queued=True)
                taken = TokenEvent(request_id=rid, index=1, worker="peer-decode")
                if self.behavior == "late_handoff":
                    await send(taken)
                    await send(queued)
                    return
                if self.behavior == "decode_waits":
                    await send(queued)
                    await send(taken)
                    await send(TokenEvent(request_id=rid, index=1, worker="peer-decode", queued=True))
                    await asyncio.sleep(self.handoff_s)
                    continue
                await send(queued)
                await asyncio.sleep(self.handoff_s)
                await send(taken)
            if self.behavior == "duplicate":
                await send(event)
                if i > 0:
                    await send(TokenEvent(request_id=rid, index=i - 1, token_ids=ids[i - 1: i + 1]))
            await asyncio.sleep(self.token_delay)
        if self.behavior == "error" and self.error_at >= len(ids):
            await send(TokenEvent(request_id=rid, index=len(ids), finished=True, finish_reason="error",
                                  error_code=self.error_code, error="scripted failure"))
            return
        usage = Usage(prompt_tokens=len(job.prompt_ids), completion_tokens=len(ids), cached_tokens=CACHED_TOKENS)
        final = TokenEvent(request_id=rid, index=len(ids), finished=True, finish_reason=finish,
                           stop_reason=stop_reason, usage=usage, timing=PEER_TIMING, worker="peer-decode")
        await send(final)
        if self.behavior == "duplicate":
            await send(final)


# ----------------------------------------------------------------------------------- the gateway


class GatewayThread:
    """`serve(config, stop_event)` on its own event loop in a thread (so blocking clients may call it)."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.url = f"http://127.0.0.1:{config.port}"
        self.error: BaseException | None = None
        self._ready = threading.Event()

    def start(self) -> GatewayThread:
        self._thread = threading.Thread(target=self._run, name="gateway", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if not self._thread.is_alive():
                raise RuntimeError(f"gateway did not start: {self.error}")
            try:
                wait_for_port(self.config.port, timeout=0.2)
                return self
            except TimeoutError:
                pass
        raise TimeoutError("gateway did not start listening")

    def _run(self) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            self._ready.set()
            await serve(self.config, self._stop)

        try:
            asyncio.run(main())
        except BaseException as exc:  # reported by start()
            self.error = exc
            self._ready.set()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(15)
        assert not self._thread.is_alive(), "gateway did not stop"


@pytest.fixture(scope="module")
def tokenizer(default_gguf) -> Tokenizer:
    return Tokenizer.from_gguf(default_gguf)


@pytest.fixture(scope="module")
def base_config(nats_server, valkey_server, default_gguf) -> GatewayConfig:
    return GatewayConfig(port=0, nats_url=nats_server.url, redis_url=valkey_server.url, model=str(default_gguf),
                         shutdown_grace_s=1.0, log_level="warning", instance="gw-test")


@pytest.fixture(scope="module")
def gateway(base_config):
    """The default-config gateway most tests share."""
    gw = GatewayThread(replace(base_config, port=free_port())).start()
    yield gw
    gw.stop()


@pytest.fixture
def make_gateway(base_config):
    started = []

    def make(**overrides) -> GatewayThread:
        gw = GatewayThread(replace(base_config, port=free_port(), **overrides)).start()
        started.append(gw)
        return gw

    yield make
    for gw in started:
        gw.stop()


@pytest.fixture
async def peer(nats_server, valkey_server, tokenizer):
    p = await ScriptedPeer(nats_server.url, valkey_server.url, tokenizer).start()
    yield p
    await p.stop()


@pytest.fixture
async def client(gateway, peer):
    """A client of the shared gateway, once that gateway has seen the peer's heartbeat."""
    async with httpx.AsyncClient(base_url=gateway.url, timeout=20) as c:
        await until(lambda: health_status(c), 200)
        yield c


MODEL = "SmolLM2-135M-Instruct"  # the default model's name, even when given as its cached file
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}]}
COMPLETION = {"model": MODEL, "prompt": "The capital of France is"}


def chat_prompt_ids(tokenizer: Tokenizer, messages) -> list[int]:
    text = render_chat(tokenizer.chat_template, messages, add_generation_prompt=True,
                       bos_token=tokenizer.bos_token or "", eos_token=tokenizer.eos_token or "")
    return tokenizer.encode(text, add_special_tokens=False)


async def stream_events(client: httpx.AsyncClient, path: str, body: dict) -> list:
    """POST with stream=true; the parsed `data:` payloads in order ("[DONE]" kept as a string)."""
    events = []
    async with client.stream("POST", path, json={**body, "stream": True}) as resp:
        assert resp.status_code == 200, await resp.aread()
        assert resp.headers["content-type"].startswith("text/event-stream")
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                payload = line[len("data: "):]
                events.append(payload if payload == "[DONE]" else json.loads(payload))
            else:
                assert line == "", line
    return events


def chat_text(events: list) -> str:
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events
                   if isinstance(e, dict) and e.get("choices"))


def request_id(body: dict) -> str:
    return body["id"].split("-", 1)[1]


async def metric_samples(client: httpx.AsyncClient) -> dict:
    """name → {frozenset(labels): value} from /metrics."""
    resp = await client.get("/metrics")
    assert resp.status_code == 200
    out: dict = defaultdict(dict)
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            out[s.name][frozenset(s.labels.items())] = s.value
    return out


# ----------------------------------------------------------------------------------------- tests

PEER_TIMING = Timing(queue_s=0.001, prefill_s=0.02, kv_write_s=0.003, decode_queue_s=0.002, kv_read_s=0.004,
                     decode_s=0.05, prefill_compute_s=0.015, decode_compute_s=0.04, prefill_core_s=0.03,
                     decode_core_s=0.06, kv_bytes_written=3 * 368640,
                     kv_bytes_read=2 * 368640)
PRICE = Price(prefill_per_s=2.0, decode_per_s=1.0, per_gb=10.0, currency="EUR")


async def test_chat_non_streaming_shape_and_job(client, peer, tokenizer):
    body = {**CHAT, "temperature": 0.5, "top_p": 0.9, "top_k": 40, "seed": 7, "max_completion_tokens": 50,
            "user": "u1", "some_future_field": {"x": 1}}
    await until(lambda: routable(client), ["peer-decode", "peer-prefill"])
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    assert data["object"] == "chat.completion" and data["model"] == MODEL
    assert data["choices"][0]["message"] == {"role": "assistant", "content": ANSWER}
    assert data["choices"][0]["finish_reason"] == "stop"
    prompt_ids = chat_prompt_ids(tokenizer, CHAT["messages"])
    n_out = len(tokenizer.encode(ANSWER, add_special_tokens=False))
    breakdown = {key: data["usage"].pop(key) for key in ("timing_ms", "cost")}
    assert breakdown == {
        "timing_ms": {"queue": 1.0, "prefill": 20.0, "kv_transfer": 7.0, "decode_queue": 2.0, "decode": 50.0},
        "cost": {"prefill_seconds": 0.015, "decode_seconds": 0.04, "prefill_core_seconds": 0.03,
                 "decode_core_seconds": 0.06, "kv_bytes": 5 * 368640,
                 "kv_transfer_seconds": pytest.approx(0.007), "currency": "USD",
                 "price": {"prefill": 0.0, "decode": 0.0, "kv_transfer": 0.0, "total": 0.0}}}
    assert data["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": n_out,
                             "total_tokens": len(prompt_ids) + n_out,
                             "prompt_tokens_details": {"cached_tokens": CACHED_TOKENS},
                             "completion_tokens_details": {"accepted_prediction_tokens": 0,
                                                           "rejected_prediction_tokens": 0},
                             "draft_tokens": 0, "accepted_tokens": 0}
    subject, job = peer.jobs[request_id(data)]
    assert subject == subjects.worker_jobs(subjects.PREFILL_JOBS, "peer-prefill")  # the router chose the one there is
    assert job.prompt_ids == prompt_ids
    p = job.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (50, 0.5, 0.9, 40, 7)
    assert 590 < job.deadline - time.time() <= 600


async def test_chat_streaming_shape_with_usage(client, peer):
    events = await stream_events(client, "/v1/chat/completions", {**CHAT, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chat_text(chunks) == ANSWER
    finish = chunks[-2]["choices"][0]
    assert finish["finish_reason"] == "stop" and finish["delta"] == {}
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-2])
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == len(peer.answer_ids)
    assert usage_chunk["usage"]["prompt_tokens_details"] == {"cached_tokens": CACHED_TOKENS}


async def test_n_choices_are_requests_of_their_own_published_after_the_first(client, peer, tokenizer):
    resp = await client.post("/v1/chat/completions", json={**CHAT, "n": 3, "seed": 7, "temperature": 0.8})
    assert resp.status_code == 200, resp.text
    data = resp.json()
    assert [c["index"] for c in data["choices"]] == [0, 1, 2]
    assert all(c["message"]["content"] == ANSWER and c["finish_reason"] == "stop" for c in data["choices"])
    n_out = len(peer.answer_ids)
    prompt_ids = chat_prompt_ids(tokenizer, CHAT["messages"])
    assert data["usage"]["prompt_tokens"] == len(prompt_ids)  # the prompt once, every choice's tokens
    assert data["usage"]["completion_tokens"] == 3 * n_out
    rid = request_id(data)
    jobs = [peer.jobs[f"{rid}-{i}"][1] for i in range(3)]
    assert [j.params.seed for j in jobs] == [7, 8, 9]  # distinct, reproducible choices
    assert all(j.prompt_ids == prompt_ids for j in jobs)
    # choices 1, 2 wait until choice 0 has a second token (its prompt's KV is in the prefix cache)
    assert jobs[1].created_at >= jobs[0].created_at + peer.token_delay and jobs[2].created_at >= jobs[1].created_at


async def test_n_choices_stream_interleaved_with_one_usage_chunk(client, peer):
    events = await stream_events(client, "/v1/chat/completions",
                                 {**CHAT, "n": 2, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    for i in (0, 1):
        mine = [c for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        assert mine[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in mine) == ANSWER
        assert [c["choices"][0]["finish_reason"] for c in mine].count("stop") == 1
        assert mine[-1]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2 * len(peer.answer_ids)
    assert all("usage" not in c for c in chunks[:-1])


async def test_best_of_generates_candidates_and_returns_n(client, peer):
    resp = await client.post("/v1/completions", json={**COMPLETION, "best_of": 3, "seed": 1})
    assert resp.status_code == 200, resp.text
    data = resp.json()
    assert len(data["choices"]) == 1 and data["choices"][0]["index"] == 0
    assert data["choices"][0]["logprobs"] is None  # asked for internally (to rank), not returned
    assert data["usage"]["completion_tokens"] == 3 * len(peer.answer_ids)  # every candidate was generated
    rid = request_id(data)
    assert [peer.jobs[f"{rid}-{i}"][1].params.logprobs for i in range(3)] == [0, 0, 0]


async def test_n_choices_disconnect_cancels_every_choice(client, peer):
    peer.behavior = "stall"
    rid = None
    async with client.stream("POST", "/v1/chat/completions", json={**CHAT, "n": 2, "stream": True}) as resp:
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                rid = request_id(chunk)
                if chunk["choices"][0]["delta"].get("content"):
                    break
    for i in range(2):
        await peer.wait_cancel(f"{rid}-{i}")


async def test_continuous_usage_stats_puts_the_tokens_so_far_in_every_chunk(client, peer):
    events = await stream_events(client, "/v1/chat/completions",
                                 {**CHAT, "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    chunks = events[:-1]
    counts = [c["usage"]["completion_tokens"] for c in chunks[1:-1]]  # the role chunk comes before any token
    assert counts == sorted(counts) and counts[-1] == len(peer.answer_ids) and len(counts) >= 2
    assert all(c["usage"]["prompt_tokens"] == chunks[-1]["usage"]["prompt_tokens"] for c in chunks[1:])


async def test_completions_both_ways(client, peer, tokenizer):
    resp = await client.post("/v1/completions", json=COMPLETION)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    assert data["object"] == "text_completion"
    assert data["choices"][0]["text"] == ANSWER and data["choices"][0]["finish_reason"] == "stop"
    prompt_ids = tokenizer.encode(COMPLETION["prompt"])
    assert data["usage"]["prompt_tokens"] == len(prompt_ids)
    assert peer.jobs[request_id(data)][1].prompt_ids == prompt_ids

    events = await stream_events(client, "/v1/completions", {**COMPLETION, "max_tokens": 3})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == tokenizer.decode(peer.answer_ids[:3])
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert not any("usage" in c for c in chunks)  # only with include_usage

    # a prompt given as token ids goes through untouched
    resp = await client.post("/v1/completions", json={**COMPLETION, "prompt": [[1, 2, 3, 4]]})
    assert resp.status_code == 200, resp.text
    assert peer.jobs[request_id(resp.json())][1].prompt_ids == [1, 2, 3, 4]


async def test_openai_client_unmodified(gateway, peer):
    def run() -> tuple:
        c = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
        models = [m.id for m in c.models.list()]
        chat = c.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=32)
        stream = c.chat.completions.create(model=MODEL, messages=CHAT["messages"], stream=True,
                                           stream_options={"include_usage": True})
        parts, usage = [], None
        for chunk in stream:
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
            if chunk.usage:
                usage = chunk.usage
        comp = c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=16)
        comp_stream = "".join(ch.choices[0].text for ch in
                              c.completions.create(model=MODEL, prompt="The capital of France is", stream=True))
        return models, chat, "".join(parts), usage, comp, comp_stream

    models, chat, streamed, usage, comp, comp_stream = await asyncio.to_thread(run)
    assert models == [MODEL]
    assert chat.choices[0].message.content == ANSWER and chat.choices[0].finish_reason == "stop"
    assert chat.usage.prompt_tokens_details.cached_tokens == CACHED_TOKENS
    assert streamed == ANSWER
    assert usage.completion_tokens == len(peer.answer_ids)
    assert comp.choices[0].text == ANSWER
    assert comp_stream == ANSWER


@pytest.mark.parametrize("stop, expected", [
    ("capital", " Paris is the "),
    (["xyz", "tal of"], " Paris is the capi"),  # the stop string spans two tokens
    (["France."], " Paris is the capital of "),
    ("nowhere", ANSWER),
])
@pytest.mark.parametrize("behavior", ["normal", "ignore_stop"])
async def test_stop_strings_never_leak(client, peer, stop, expected, behavior):
    peer.behavior = behavior
    events = await stream_events(client, "/v1/chat/completions", {**CHAT, "stop": stop})
    assert events[-1] == "[DONE]"
    assert chat_text(events[:-1]) == expected  # no chunk carried any part of the cut text
    finish = events[-2]["choices"][0]
    assert finish["finish_reason"] == "stop"
    if expected != ANSWER:
        assert finish["stop_reason"] in ([stop] if isinstance(stop, str) else stop)
    resp = await client.post("/v1/completions", json={**COMPLETION, "stop": stop})
    assert resp.json()["choices"][0]["text"] == expected


@pytest.mark.parametrize("text, stop, expected", [
    (" Paris is the capital. User: hi", ["User:"], " Paris is the capital. "),
    (" Flags: 🇫🇷🇩🇪 and more", ["🇩🇪"], " Flags: 🇫🇷"),  # stop inside multi-token characters
    (" a\n\nb\n\nc", ["\n\n"], " a"),
    (" no stop here", ["zzz", "qq"], " no stop here"),
    (" aaaa", ["aaa"], " "),
])
def test_output_text_streams_only_a_prefix_of_the_final_text(tokenizer, text, stop, expected):
    ids = tokenizer.encode(text, add_special_tokens=False)
    out = OutputText(tokenizer, tokenizer.encode("Hello"), stop=stop)
    sent = ""
    for token in ids:  # one token per event, as a decode worker sends them
        sent += out.add([token])
        assert expected.startswith(sent), (sent, expected)  # nothing streamed is ever cut later
    sent += out.finish()
    assert sent == expected == out.text
    assert out.stop_string == (None if expected == text else next(s for s in stop if s in text))


async def test_duplicates_are_dropped(client, peer):
    peer.behavior = "duplicate"
    events = await stream_events(client, "/v1/chat/completions", CHAT)
    assert chat_text(events[:-1]) == ANSWER and events[-1] == "[DONE]"
    resp = await client.post("/v1/completions", json=COMPLETION)
    assert resp.json()["choices"][0]["text"] == ANSWER


async def test_gap_resubmits_after_the_tokens_received_then_errors_and_cancels(client, peer):
    """Lost events (a gap) are recovered like a dead worker: the request is resubmitted with the
    tokens received so far, and the attempt it replaces cancelled; this peer loses token 2 every
    time, so after the migrations are used up the stream ends with an error and a Cancel of all."""
    peer.behavior = "gap"
    events = await stream_events(client, "/v1/chat/completions", CHAT)
    assert events[-1] == "[DONE]"
    assert "error" in events[-2] and "broken" in events[-2]["error"]["message"]
    rid = request_id(events[0])
    _, last_job = peer.jobs[rid]
    assert last_job.attempt == 2 and last_job.resume_ids == peer.answer_ids[:2]
    assert chat_text(events[:-2]) == peer.tokenizer.decode(peer.answer_ids[:2])
    await peer.wait_cancel(rid)
    for _ in range(50):  # the targeted cancels came first; the final one cancels every attempt
        if peer.cancels[rid].attempt == -1:
            break
        await asyncio.sleep(0.1)
    assert peer.cancels[rid].attempt == -1


async def test_worker_error_event(gateway, client, peer):
    peer.behavior = "error"
    events = await stream_events(client, "/v1/chat/completions", CHAT)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["message"] == "scripted failure"
    assert chat_text(events[:-2]) == peer.tokenizer.decode(peer.answer_ids[:2])

    resp = await client.post("/v1/completions", json=COMPLETION)
    assert resp.status_code == 500 and resp.json()["error"]["message"] == "scripted failure"

    def with_client() -> str:  # the official client raises on the in-stream error event
        c = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
        parts = []
        with pytest.raises(openai.APIError, match="scripted failure"):
            for chunk in c.chat.completions.create(model=MODEL, messages=CHAT["messages"], stream=True):
                parts.append(chunk.choices[0].delta.content or "")
        return "".join(parts)

    assert await asyncio.to_thread(with_client) == peer.tokenizer.decode(peer.answer_ids[:2])

    peer.error_code, peer.error_at = ErrorCode.OVERLOADED, 0
    resp = await client.post("/v1/chat/completions", json=CHAT)
    assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
    assert resp.json()["error"]["code"] == "overloaded"


async def test_tokenize_detokenize_and_version(client, tokenizer):
    r = await client.post("/tokenize", json={"model": MODEL, "prompt": "Hello world", "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tokenizer.encode("Hello world") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == CONTEXT and len(body["token_strs"]) == body["count"]
    r = await client.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]})
    chat_ids = r.json()["tokens"]
    assert tokenizer.decode(chat_ids).rstrip().endswith("assistant")  # the template's generation prompt
    r = await client.post("/detokenize", json={"tokens": body["tokens"]})
    assert r.json() == {"prompt": "Hello world"}
    for path, bad, needle in (("/tokenize", {"prompt": "a", "messages": []}, "either"),
                              ("/tokenize", {}, "either"),
                              ("/detokenize", {"tokens": [10**9]}, "vocabulary"),
                              ("/detokenize", {"tokens": "abc"}, "tokens"),
                              ("/tokenize", {"model": "gpt-4", "prompt": "a"}, "gpt-4")):
        r = await client.post(path, json=bad)
        assert r.status_code in (400, 404) and needle in r.text, (path, bad, r.text)
    r = await client.get("/version")
    assert r.status_code == 200 and r.json()["version"]


async def test_access_log_has_one_line_per_request(client, peer, caplog):
    caplog.set_level(logging.INFO, logger="pdserve.access")
    ok = await client.post("/v1/chat/completions", json=CHAT)
    await stream_events(client, "/v1/chat/completions", CHAT)
    bad = await client.post("/v1/chat/completions", json={**CHAT, "temperature": 9})
    assert ok.status_code == 200 and bad.status_code == 400
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # the streamed request's line comes after its last chunk
        lines = [r for r in caplog.records if r.name == "pdserve.access"]
        if len(lines) >= 3:
            break
        await asyncio.sleep(0.05)
    assert len(lines) == 3, [r.getMessage() for r in lines]
    done = [r.getMessage() for r in lines if " 200 " in r.getMessage()]
    assert len(done) == 2 and all(f"completion={len(peer.answer_ids)}" in m and "prompt=" in m for m in done)
    [rejected] = [r for r in lines if " 400 " in r.getMessage()]
    assert rejected.levelno == logging.WARNING and rejected.getMessage().startswith("POST /v1/chat/completions 400")


async def test_models_endpoint(client, peer):
    resp = await client.get("/v1/models")
    assert resp.status_code == 200
    assert [m["id"] for m in resp.json()["data"]] == [MODEL]
    assert (await client.get(f"/v1/models/{MODEL}")).status_code == 200
    alias = await client.post("/v1/completions", json={**COMPLETION, "model": "SmolLM2-135M-Instruct.Q4_1"})
    assert alias.status_code == 200  # the file's own name is accepted too
    missing = await client.get("/v1/models/gpt-4")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


async def test_metrics_after_a_request(client, peer):
    resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": False})
    assert resp.status_code == 200
    events = await stream_events(client, "/v1/chat/completions", CHAT)
    assert events[-1] == "[DONE]"
    text = (await client.get("/metrics")).text
    for name in CONTRACT_NAMES + ("pdserve_requests_total",):
        assert name in text, name
    m = await metric_samples(client)
    decode_labels = frozenset({"service": "decode", "instance": "peer-decode"}.items())
    prefill_labels = frozenset({"service": "prefill", "instance": "peer-prefill"}.items())
    assert m["pdserve_kv_blocks_in_use"][decode_labels] == 5
    assert m["pdserve_prefix_cache_queries_total"][prefill_labels] == 40
    assert m["pdserve_prefix_cache_hits_total"][prefill_labels] == 30
    assert m["pdserve_requests_waiting"][decode_labels] == 2
    gateway_labels = frozenset({"service": "gateway", "instance": "gw-test"}.items())
    assert m["pdserve_requests_running"][gateway_labels] == 0
    assert m["pdserve_requests_total"][frozenset({"status": "success"}.items())] >= 2
    for hist in ("pdserve_time_to_first_token_seconds", "pdserve_inter_token_latency_seconds",
                 "pdserve_e2e_request_latency_seconds", "pdserve_kv_transfer_seconds"):
        assert m[f"{hist}_count"][frozenset()] >= 1, hist
    assert m["pdserve_kv_transfer_seconds_sum"][frozenset()] > 0


async def test_client_disconnect_publishes_cancel(client, peer):
    peer.behavior = "stall"  # two tokens, then nothing: the client gives up mid-stream
    rid = None
    async with client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                rid = request_id(chunk)
                if chunk["choices"][0]["delta"].get("content"):
                    break
    cancel = await peer.wait_cancel(rid)
    assert cancel.request_id == rid and "disconnect" in cancel.reason
    gateway_row = frozenset({"service": "gateway", "instance": "gw-test"}.items())

    async def in_flight() -> float:
        return (await metric_samples(client))["pdserve_requests_running"][gateway_row]

    await until(in_flight, 0)  # the slot is freed right after the Cancel goes out
    m = await metric_samples(client)
    assert m["pdserve_requests_total"][frozenset({"status": "cancelled"}.items())] >= 1


async def test_non_streaming_disconnect_publishes_cancel(gateway, peer):
    peer.behavior = "stall"
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as c:
        waiting = asyncio.create_task(c.post("/v1/completions", json=COMPLETION))
        await until(lambda: len(peer.jobs), 1)
        waiting.cancel()  # the client gives up: its connection closes
        with pytest.raises(asyncio.CancelledError):
            await waiting
    rid = next(iter(peer.jobs))
    await peer.wait_cancel(rid)


async def test_inactivity_timeout_ends_stream(make_gateway, peer):
    gw = make_gateway(inactivity_timeout_s=0.5)
    peer.behavior = "stall"
    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
        await until(lambda: health_status(c), 200)  # the gateway has seen the peer
        start = time.monotonic()
        events = await stream_events(c, "/v1/chat/completions", CHAT)
        assert time.monotonic() - start < 5
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == "timeout"
        assert chat_text(events[:-2]) == peer.tokenizer.decode(peer.answer_ids[:2])
        await peer.wait_cancel(request_id(events[0]))

        resp = await c.post("/v1/completions", json=COMPLETION)
        assert resp.status_code == 504 and resp.json()["error"]["code"] == "timeout"
        await peer.wait_cancel(list(peer.jobs)[-1])


async def test_a_request_queued_for_decode_waits_the_queue_timeout_and_only_then(make_gateway, peer):
    """Between prefill and decode a request waits in the decode queue as long as that pool is busy:
    after the prefill worker's "queued" notice the gateway waits its queue timeout, not its inactivity
    timeout. A decode worker's "taken" notice that overtakes the prefill worker's leaves the request
    watched as before: silence after it times out at the inactivity timeout. A decode worker holding
    the request may say it is queued there (waiting for room in its KV cache). A request queued
    for decode once no decode worker heartbeats: no one will take it."""
    gw = make_gateway(inactivity_timeout_s=0.5, queue_timeout_s=30, worker_alive_s=1.0)
    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
        await until(lambda: health_status(c), 200)
        peer.behavior, peer.handoff_s = "handoff", 1.5
        events = await stream_events(c, "/v1/chat/completions", CHAT)
        assert not any("error" in e for e in events if isinstance(e, dict)), events
        assert chat_text(events) == peer.tokenizer.decode(peer.answer_ids)

        peer.behavior = "decode_waits"  # the decode worker holding it waits for room: still queued
        events = await stream_events(c, "/v1/chat/completions", CHAT)
        assert not any("error" in e for e in events if isinstance(e, dict)), events
        assert chat_text(events) == peer.tokenizer.decode(peer.answer_ids)

        peer.behavior = "late_handoff"
        start = time.monotonic()
        events = await stream_events(c, "/v1/chat/completions", CHAT)
        assert events[-2]["error"]["code"] == "timeout" and time.monotonic() - start < 5, events[-2:]

        peer.behavior, peer.handoff_s = "handoff", 30
        events_task = asyncio.create_task(stream_events(c, "/v1/chat/completions", CHAT))
        await asyncio.sleep(0.5)  # the request is in the decode queue: then the decode pool goes
        peer.silent.add("decode")
        start = time.monotonic()
        events = await events_task
        assert events[-2]["error"]["code"] == "unavailable", events[-2:]
        assert "none is alive" in events[-2]["error"]["message"] and time.monotonic() - start < 5


async def test_a_job_no_worker_took_is_withdrawn_from_its_queue_when_the_request_ends(make_gateway, peer):
    """A request that times out in the queue takes its job out of the queue with it: a worker that
    never heard the Cancel (started later, or restarted on its own subject) must not run it."""
    gw = make_gateway(inactivity_timeout_s=0.5, queue_timeout_s=0.5)
    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
        await until(lambda: health_status(c), 200)
        peer.paused = True
        await asyncio.sleep(1.0)  # the pull requests already out expire (0.5 s)
        resp = await c.post("/v1/completions", json=COMPLETION)
        assert resp.status_code == 504 and "no worker took" in resp.json()["error"]["message"]
        info = await peer.js.stream_info(subjects.PREFILL_STREAM)
        assert info.state.messages == 0  # (work-queue retention: only unacked jobs stay)
        peer.paused = False
        assert (await c.post("/v1/completions", json=COMPLETION)).status_code == 200
        assert len(peer.jobs) == 1  # the second request's; the first one's never reached a worker


async def test_a_queued_request_whose_pool_is_gone_ends_at_the_inactivity_timeout(make_gateway, peer):
    """A job waits in its queue up to the queue timeout while a worker that could take it is alive;
    when no prefill (or colocated) worker heartbeats any more, nobody will: the request ends at the
    inactivity timeout, 503, saying so — and the job leaves its queue with it."""
    gw = make_gateway(inactivity_timeout_s=0.5, queue_timeout_s=30, worker_alive_s=1.0)
    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
        await until(lambda: health_status(c), 200)
        peer.paused = True
        await asyncio.sleep(1.0)  # the pull requests already out expire (0.5 s)
        request = asyncio.create_task(c.post("/v1/completions", json=COMPLETION))
        await asyncio.sleep(0.5)
        peer.silent.update(("prefill", "decode"))
        start = time.monotonic()
        resp = await request
        assert resp.status_code == 503 and "prefill or colocated worker and none is alive" in resp.text, resp.text
        assert time.monotonic() - start < 5
        info = await peer.js.stream_info(subjects.PREFILL_STREAM)
        assert info.state.messages == 0


async def test_priced_gateway_reports_cost_in_usage_and_counters(make_gateway, peer):
    """--price: each response's usage.cost in money, and /metrics' counters sum the requests' values."""
    gw = make_gateway(price=PRICE)
    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
        await until(lambda: health_status(c), 200)
        events = await stream_events(c, "/v1/chat/completions", {**CHAT, "stream_options": {"include_usage": True}})
        cost = events[-2]["usage"]["cost"]
        gb = 5 * 368640 / 1e9
        assert cost["currency"] == "EUR"
        assert cost["price"] == pytest.approx({"prefill": 0.03 * 2.0, "decode": 0.06 * 1.0, "kv_transfer": gb * 10.0,
                                               "total": 0.06 + 0.06 + gb * 10.0})  # per core-second
        resp = await c.post("/v1/completions", json={**COMPLETION, "n": 2})
        assert resp.json()["usage"]["cost"]["prefill_seconds"] == pytest.approx(2 * 0.015)  # every choice's
        samples = await metric_samples(c)
        assert samples["pdserve_prefill_seconds_total"][frozenset()] == pytest.approx(3 * 0.015)
        assert samples["pdserve_decode_seconds_total"][frozenset()] == pytest.approx(3 * 0.04)
        assert samples["pdserve_kv_transfer_bytes_total"][frozenset()] == 3 * 5 * 368640
        by_phase = {dict(k)["phase"]: v for k, v in samples["pdserve_cost_total"].items()}
        assert samples["pdserve_prefill_core_seconds_total"][frozenset()] == pytest.approx(3 * 0.03)
        assert by_phase == pytest.approx({"prefill": 3 * 0.06, "decode": 3 * 0.06, "kv_transfer": 3 * gb * 10.0})
        ttft = samples["gen_ai_server_time_to_first_token_seconds_count"]
        assert sum(ttft.values()) == 2 and {dict(k)["gen_ai_operation_name"] for k in ttft} == {"chat",
                                                                                               "text_completion"}
        assert sum(samples["gen_ai_server_request_duration_seconds_count"].values()) == 2


async def test_dashboard_and_grafana_read_only_metrics_that_exist(client):
    """/dashboard serves its page and script (nothing from another origin), and every metric the
    script or the Grafana dashboard under deploy/ reads is one the gateway exports."""
    resp = await client.post("/v1/chat/completions", json=CHAT)  # labelled counters appear with a request
    assert resp.status_code == 200
    page = await client.get("/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<script src="/dashboard.js">' in page.text and "http" not in page.text.replace("http-equiv", "")
    script = await client.get("/dashboard.js")
    assert script.status_code == 200 and "javascript" in script.headers["content-type"]
    assert not re.search(r"https?://", script.text)  # no CDN, no other host
    exported = set((await metric_samples(client)).keys())
    used = set(re.findall(r'"((?:pdserve|gen_ai)_[a-z_]+)"', script.text))
    grafana = json.loads((Path(__file__).parents[2] / "deploy/grafana/pdserve-dashboard.json").read_text())
    exprs = [t["expr"] for p in grafana["panels"] for t in p["targets"]]
    used_by_grafana = set(re.findall(r"\b((?:pdserve|gen_ai)_[a-z_]+)", " ".join(exprs)))
    assert len(used) >= 12 and len(used_by_grafana) >= 12
    assert used - exported == set() and used_by_grafana - exported == set()


def test_price_parses_and_rejects():
    assert Price.parse("prefill=0.5,decode=0.25, gb=1e-2,currency=EUR") == Price(0.5, 0.25, 0.01, "EUR")
    assert Price.parse("") == Price()
    for bad in ("prefill", "tokens=1", "decode=-1"):
        with pytest.raises(ValueError):
            Price.parse(bad)


async def test_admission_limit_429(make_gateway, peer):
    gw = make_gateway(max_concurrent_requests=1)
    peer.behavior = "stall"
    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
        await until(lambda: health_status(c), 200)  # the gateway has seen the peer
        async with c.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as held:
            async for line in held.aiter_lines():
                if '"content":"' in line and '"content":""' not in line:
                    break
            busy = await c.post("/v1/chat/completions", json=CHAT)
            assert busy.status_code == 429
            assert busy.headers["retry-after"] == "1"
            assert busy.json()["error"]["code"] == "rate_limit_exceeded"
        peer.behavior = "normal"

        async def chat_status() -> int:
            return (await c.post("/v1/chat/completions", json=CHAT)).status_code

        await until(chat_status, 200)  # the held request's slot frees once its disconnect is processed


async def test_api_key(make_gateway, peer):
    gw = make_gateway(api_key="sekret")
    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
        await until(lambda: health_status(c), 200)  # the gateway has seen the peer
        denied = await c.get("/v1/models")
        assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
        wrong = await c.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        ok = await c.get("/v1/models", headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200
        chat = await c.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer sekret"})
        assert chat.status_code == 200
        assert (await c.get("/health")).status_code == 200
        assert (await c.get("/metrics")).status_code == 200

    def with_client() -> str:
        oc = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="sekret", max_retries=0)
        return oc.chat.completions.create(model=MODEL, messages=CHAT["messages"]).choices[0].message.content

    assert await asyncio.to_thread(with_client) == ANSWER


async def test_conditional_mode_routes_by_prompt_length(make_gateway, peer):
    gw = make_gateway(mode="conditional", conditional_threshold=32)
    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
        await until(lambda: routable(c), ["peer-decode", "peer-prefill"])  # the router has the peer's stats
        short = await c.post("/v1/completions", json={**COMPLETION, "prompt": "Hi"})
        long = await c.post("/v1/completions", json={**COMPLETION, "prompt": "word " * 60})
        assert short.status_code == 200 and long.status_code == 200
        assert short.json()["choices"][0]["text"] == long.json()["choices"][0]["text"] == ANSWER
    # each to the one worker of its pool, on that worker's own subject
    assert peer.jobs[request_id(short.json())][0] == subjects.worker_jobs(subjects.DECODE_DIRECT, "peer-decode")
    assert peer.jobs[request_id(long.json())][0] == subjects.worker_jobs(subjects.PREFILL_JOBS, "peer-prefill")


async def test_colocated_mode_needs_a_colocated_worker(make_gateway, nats_server, valkey_server, tokenizer):
    gw = make_gateway(mode="colocated")
    p = await ScriptedPeer(nats_server.url, valkey_server.url, tokenizer, roles=("colocated",)).start()
    try:
        async with httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
            await until(lambda: routable(c), ["peer-colocated"])
            health = await c.get("/health")
            assert health.json()["workers"]["colocated"] == ["peer-colocated"]
            resp = await c.post("/v1/chat/completions", json=CHAT)
            assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"] == ANSWER
            assert p.jobs[request_id(resp.json())][0] == subjects.worker_jobs(subjects.PREFILL_JOBS, "peer-colocated")
    finally:
        await p.stop()


async def test_health_says_starting_until_every_expected_instance_reported(make_gateway, peer):
    gw = make_gateway(expect={"prefill": 1, "decode": 2})
    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
        starting = await c.get("/health")
        assert starting.status_code == 503 and starting.json()["error"]["code"] == "starting"
        assert "decode 1/2" in starting.json()["error"]["message"]
    gw = make_gateway(expect={"prefill": 1, "decode": 1})
    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
        await until(lambda: health_status(c), 200)
        nats = (await c.get("/health")).json()["nats"]  # where the gateway is connected (one server here)
        assert nats["connected"] and nats["url"].endswith(f":{nats_port(gw)}") and nats["cluster"] is None


def nats_port(gw) -> int:
    return int(gw.config.nats_url.rsplit(":", 1)[1])


async def test_reset_prefix_cache_asks_every_worker_behind_the_api_key(make_gateway, peer):
    gw = make_gateway(api_key="sekret")
    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
        await until(lambda: health_status(c), 200)
        assert (await c.post("/reset_prefix_cache")).status_code == 401
        resp = await c.post("/reset_prefix_cache", headers={"Authorization": "Bearer sekret"})
        assert resp.status_code == 200, resp.text
        assert resp.json() == {"reset": ["decode peer-decode", "prefill peer-prefill"], "blocks_forgotten": 6}
        assert peer.resets == 1


async def test_health_follows_workers(make_gateway, nats_server, valkey_server, tokenizer):
    redis_url = f"{valkey_server.url}/15"  # a keyspace no other test's peer writes to
    gw = make_gateway(redis_url=redis_url, worker_alive_s=0.5, registry_cache_s=0.1)
    redis = valkey.connect(redis_url)
    await redis.flushdb()
    try:
        async with httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
            down = await c.get("/health")
            assert down.status_code == 503 and "no live" in down.json()["error"]["message"]
            assert down.headers["retry-after"] == "1"
            refused = await c.post("/v1/chat/completions", json=CHAT)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "no_workers"

            # heartbeats alone (a peer with its registry keys elsewhere) make it healthy ...
            p = await ScriptedPeer(nats_server.url, valkey_server.url, tokenizer).start()
            try:
                await until(lambda: health_status(c), 200)
                up = await c.get("/health")
                assert up.json()["status"] == "ok"
                assert up.json()["workers"]["decode"] == ["peer-decode"]
            finally:
                await p.stop()
            # ... and silence makes it unhealthy again (a heartbeat still in flight may arrive late)
            await until(lambda: health_status(c), 503)

            # registry keys alone are enough too
            for role in ("prefill", "decode"):
                await redis.set(subjects.registry_key(role, f"reg-{role}"), b"", ex=5)
            await until(lambda: health_status(c), 200)
    finally:
        await redis.flushdb()
        await redis.aclose()


async def health_status(c: httpx.AsyncClient) -> int:
    return (await c.get("/health")).status_code


async def routable(c: httpx.AsyncClient) -> list[str]:
    """The workers the router would choose from now (GET /router)."""
    return sorted((await c.get("/router")).json()["workers"])


async def until(probe, expected, timeout: float = 10.0, interval: float = 0.05):
    """Poll `probe()` (a value or an awaitable) until it gives `expected`: for state that changes with
    time (liveness windows, slots freed after a disconnect) rather than by an event we can wait on."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        value = await value if inspect.isawaitable(value) else value
        if value == expected:
            return value
        assert time.monotonic() < deadline, f"still {value!r}, expected {expected!r}"
        await asyncio.sleep(interval)


def _long_prompt(n_words: int) -> str:
    return "hi " * n_words


BAD_REQUESTS = [
    # (case, path, body (dict, or raw bytes), extra headers, status, message must contain)
    ("malformed json", "/v1/chat/completions", b'{"model": "x", "messages": [', {}, 400, "JSON"),
    ("nan is not json", "/v1/completions", b'{"prompt": "a", "temperature": NaN}', {}, 400, "JSON"),
    ("body is an array", "/v1/chat/completions", [1, 2], {}, 400, "object"),
    ("temperature -1", "/v1/chat/completions", {**CHAT, "temperature": -1}, {}, 400, "temperature"),
    ("temperature 3", "/v1/chat/completions", {**CHAT, "temperature": 3}, {}, 400, "temperature"),
    ("temperature string", "/v1/chat/completions", {**CHAT, "temperature": "0.5"}, {}, 400, "temperature"),
    ("top_p 0", "/v1/chat/completions", {**CHAT, "top_p": 0}, {}, 400, "top_p"),
    ("top_p 1.5", "/v1/completions", {**COMPLETION, "top_p": 1.5}, {}, 400, "top_p"),
    ("top_k -2", "/v1/completions", {**COMPLETION, "top_k": -2}, {}, 400, "top_k"),
    ("max_tokens 0", "/v1/completions", {**COMPLETION, "max_tokens": 0}, {}, 400, "max_tokens"),
    ("max_tokens -5", "/v1/chat/completions", {**CHAT, "max_tokens": -5}, {}, 400, "max_tokens"),
    ("max_tokens float", "/v1/completions", {**COMPLETION, "max_tokens": 5.5}, {}, 400, "max_tokens"),
    ("max_tokens over context", "/v1/completions", {**COMPLETION, "max_tokens": 100000}, {}, 400, str(CONTEXT)),
    ("n=0", "/v1/chat/completions", {**CHAT, "n": 0}, {}, 400, "n"),
    ("n=17", "/v1/chat/completions", {**CHAT, "n": 17}, {}, 400, "n"),
    ("best_of below n", "/v1/completions", {**COMPLETION, "n": 3, "best_of": 2}, {}, 400, "best_of"),
    ("best_of streamed", "/v1/completions", {**COMPLETION, "best_of": 2, "stream": True}, {}, 400, "best_of"),
    ("stream not bool", "/v1/chat/completions", {**CHAT, "stream": "yes"}, {}, 400, "stream"),
    ("stream_options without stream", "/v1/chat/completions", {**CHAT, "stream_options": {"include_usage": True}},
     {}, 400, "stream_options"),
    ("seed string", "/v1/completions", {**COMPLETION, "seed": "42"}, {}, 400, "seed"),
    ("empty messages", "/v1/chat/completions", {**CHAT, "messages": []}, {}, 400, "messages"),
    ("messages not a list", "/v1/chat/completions", {**CHAT, "messages": "hello"}, {}, 400, "messages"),
    ("bad role", "/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "hi"}]}, {}, 400,
     "role"),
    ("content wrong type", "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": 5}]}, {}, 400,
     "content"),
    ("image content part", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     {}, 400, "content"),
    ("missing messages", "/v1/chat/completions", {"model": MODEL}, {}, 400, "messages"),
    ("missing prompt", "/v1/completions", {"model": MODEL}, {}, 400, "prompt"),
    ("empty prompt", "/v1/completions", {**COMPLETION, "prompt": ""}, {}, 400, "prompt"),
    ("two prompts", "/v1/completions", {**COMPLETION, "prompt": ["a", "b"]}, {}, 400, "prompt"),
    ("token id outside vocab", "/v1/completions", {**COMPLETION, "prompt": [1, 10**9]}, {}, 400, "vocabulary"),
    ("stop list of 5", "/v1/chat/completions", {**CHAT, "stop": ["a", "b", "c", "d", "e"]}, {}, 400, "stop"),
    ("empty stop string", "/v1/chat/completions", {**CHAT, "stop": ""}, {}, 400, "stop"),
    ("min_tokens over max_tokens", "/v1/completions", {**COMPLETION, "max_tokens": 2, "min_tokens": 5}, {}, 400,
     "min_tokens"),
    ("top_logprobs without logprobs", "/v1/chat/completions", {**CHAT, "top_logprobs": 3}, {}, 400, "logprobs"),
    ("top_logprobs 21", "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, {}, 400,
     "top_logprobs"),
    ("completions logprobs 21", "/v1/completions", {**COMPLETION, "logprobs": 21}, {}, 400, "logprobs"),
    ("presence_penalty 3", "/v1/chat/completions", {**CHAT, "presence_penalty": 3}, {}, 400, "presence_penalty"),
    ("frequency_penalty -2.5", "/v1/completions", {**COMPLETION, "frequency_penalty": -2.5}, {}, 400,
     "frequency_penalty"),
    ("repetition_penalty 0", "/v1/completions", {**COMPLETION, "repetition_penalty": 0}, {}, 400, "repetition_penalty"),
    ("min_p 2", "/v1/completions", {**COMPLETION, "min_p": 2}, {}, 400, "min_p"),
    ("logit_bias key not an id", "/v1/chat/completions", {**CHAT, "logit_bias": {"hello": 1}}, {}, 400, "logit_bias"),
    ("logit_bias value 150", "/v1/chat/completions", {**CHAT, "logit_bias": {"5": 150}}, {}, 400, "logit_bias"),
    ("logit_bias id outside vocab", "/v1/chat/completions", {**CHAT, "logit_bias": {str(10**9): 1}}, {}, 400,
     "logit_bias"),
    ("tools", "/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, {}, 400, "tools"),
    ("unknown model", "/v1/chat/completions", {**CHAT, "model": "gpt-4"}, {}, 404, "gpt-4"),
    ("not json content type", "/v1/completions", b"prompt=hello", {"content-type": "text/plain"}, 415,
     "Content-Type"),
    ("body too large", "/v1/completions", b'{"prompt": "' + b"a" * (5 * 1024 * 1024) + b'"}', {}, 413, "limit"),
    ("unknown route", "/v1/embeddings", COMPLETION, {}, 404, ""),
]


async def test_bad_requests(client, peer, tokenizer):
    for case, path, body, headers, status, needle in BAD_REQUESTS:
        if isinstance(body, bytes):
            resp = await client.post(path, content=body, headers={"content-type": "application/json", **headers})
        else:
            resp = await client.post(path, json=body, headers=headers)
        assert resp.status_code == status, (case, resp.status_code, resp.text[:300])
        error = resp.json()["error"]
        assert isinstance(error["message"], str) and error["message"], case
        assert needle in error["message"] or needle == error.get("param"), (case, error)

    # a prompt too long for the context: alone, and with max_tokens; both numbers named
    prompt = _long_prompt(CONTEXT + 100)
    n = len(tokenizer.encode(prompt))
    resp = await client.post("/v1/completions", json={**COMPLETION, "prompt": prompt})
    assert resp.status_code == 400 and str(n) in resp.json()["error"]["message"]
    assert str(CONTEXT) in resp.json()["error"]["message"]
    prompt = _long_prompt(CONTEXT - 200)
    n = len(tokenizer.encode(prompt))
    resp = await client.post("/v1/completions", json={**COMPLETION, "prompt": prompt, "max_tokens": 500})
    message = resp.json()["error"]["message"]
    assert resp.status_code == 400 and str(n) in message and "500" in message and str(CONTEXT) in message

    assert (await client.get("/health")).status_code == 200
    ok = await client.post("/v1/chat/completions", json=CHAT)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == ANSWER
    m = await metric_samples(client)
    assert m["pdserve_requests_total"][frozenset({"status": "invalid"}.items())] >= len(BAD_REQUESTS) - 1


async def test_stopping_gateway_ends_open_streams_with_an_error_event(make_gateway, peer):
    """A stream still open when the gateway stops (its grace over) gets an SSE error event
    ("service shutting down") and [DONE], never a bare close; the workers get a Cancel."""
    gw = make_gateway(shutdown_grace_s=0.5)
    peer.behavior = "stall"
    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
        await until(lambda: health_status(c), 200)
        events = []
        async with c.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
            stopping = None
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[6:]
                events.append(payload if payload == "[DONE]" else json.loads(payload))
                if stopping is None and chat_text(events):  # streaming: now stop the gateway
                    stopping = asyncio.create_task(asyncio.to_thread(gw.stop))
        await stopping
    assert events[-1] == "[DONE]", events
    assert events[-2]["error"]["message"] == "service shutting down" and events[-2]["error"]["code"] == "unavailable"
    await peer.wait_cancel(request_id(events[0]))


async def test_nats_outage_new_requests_get_a_fast_503_and_serving_resumes(make_gateway, valkey_server, tokenizer,
                                                                           tmp_path):
    """NATS down: /health and new requests answer 503 with Retry-After at once (not after a
    publish timeout, not after the inactivity timeout); a stream in flight ends with an error
    that names NATS; once NATS is back everything reconnects and serves by itself."""
    from shared.transport.servers import start_nats

    nats = start_nats(workdir=tmp_path / "nats")
    gw = make_gateway(nats_url=nats.url, inactivity_timeout_s=2.0)
    p = await ScriptedPeer(nats.url, valkey_server.url, tokenizer).start()
    try:
        p.behavior = "stall"
        async with httpx.AsyncClient(base_url=gw.url, timeout=20) as c:
            await until(lambda: health_status(c), 200)
            events = []
            async with c.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: "):
                        payload = line[6:]
                        events.append(payload if payload == "[DONE]" else json.loads(payload))
                        if len(events) == 2:
                            nats.stop()  # mid-stream
            assert events[-1] == "[DONE]" and "NATS" in events[-2]["error"]["message"], events[-2:]
            t0 = time.monotonic()
            refused = await c.post("/v1/chat/completions", json=CHAT)
            assert time.monotonic() - t0 < 1.0
            assert refused.status_code == 503 and refused.headers["retry-after"] == "2", refused.text
            assert "NATS" in refused.json()["error"]["message"]
            assert (await c.get("/health")).status_code == 503
            nats.start()
            p.behavior = "normal"

            async def chat_status() -> int:
                return (await c.post("/v1/chat/completions", json=CHAT)).status_code

            await until(chat_status, 200, timeout=20)
    finally:
        await p.stop()
        nats.stop()
