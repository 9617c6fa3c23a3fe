"""One streaming request to an OpenAI-compatible server → a RequestRecord.

Times are seconds from the run's start (`time.perf_counter()` based; the run's `started_unix_s` is that
start in wall-clock time). A token time is the arrival of an SSE chunk carrying non-empty text; the
token count is the server's `usage.completion_tokens` when it sends one (stream_options.include_usage),
else the number of such chunks (a chunk can carry more than one token when a server holds back a
partial UTF-8 character, so that count can be low).

Every request ends in exactly one status:

    ok                200, text, a finish chunk and [DONE], and (ignore_eos) as many tokens as asked
    http_error        a non-200 answer (the body's error message is kept)
    sse_error         an `data: {"error": ...}` event in the stream
    cut_off           the stream ended early: no [DONE], or fewer tokens than asked with ignore_eos
    timeout           no end within the request timeout
    connection_error  the connection failed or broke
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from services.bench.workloads import RequestSpec

STATUSES = ("ok", "http_error", "sse_error", "cut_off", "timeout", "connection_error")


@dataclass
class RequestRecord:
    index: int
    kind: str
    max_tokens: int
    prompt_tokens: int  # the server's usage.prompt_tokens when it sent one, else the workload's estimate
    scheduled_s: float  # when the arrival process wanted it sent
    sent_s: float = 0.0
    end_s: float = 0.0
    token_times_s: list[float] = field(default_factory=list)  # arrival of each non-empty chunk
    output_tokens: int = 0
    usage_reported: bool = False
    finish_reason: str | None = None
    done: bool = False  # [DONE] seen
    status: str = "ok"
    http_status: int | None = None
    error: str = ""
    # pdserve's usage.cost and usage.timing_ms (other servers send none): what `pdserve cost` reads
    cost: dict[str, Any] | None = None
    timing_ms: dict[str, float] | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when the server sends it
    draft_tokens: int | None = None  # pdserve's usage.draft_tokens: speculative tokens its steps verified

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def ttft_s(self) -> float | None:
        return self.token_times_s[0] - self.sent_s if self.token_times_s else None

    @property
    def e2el_s(self) -> float:
        return self.end_s - self.sent_s

    @property
    def tpot_s(self) -> float | None:
        """(E2EL − TTFT) / (output tokens − 1): the mean time per token after the first."""
        if not self.token_times_s or self.output_tokens < 2:
            return None
        return (self.end_s - self.token_times_s[0]) / (self.output_tokens - 1)

    @property
    def itls_s(self) -> list[float]:
        t = self.token_times_s
        return [b - a for a, b in zip(t, t[1:])]

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"ttft_s": self.ttft_s, "tpot_s": self.tpot_s, "e2el_s": self.e2el_s}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RequestRecord:
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


@dataclass(frozen=True)
class Target:
    """Where and how to send: base URL (…/v1 is appended), model name, endpoint kind, request extras."""

    base_url: str
    model: str
    endpoint: str = "completions"  # "completions" | "chat"
    temperature: float = 0.0
    ignore_eos: bool = True
    api_key: str | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)
    request_timeout_s: float = 600.0

    @property
    def url(self) -> str:
        path = "chat/completions" if self.endpoint == "chat" else "completions"
        return f"{self.base_url.rstrip('/')}/v1/{path}"

    def body(self, spec: RequestSpec) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "max_tokens": spec.max_tokens, "temperature": self.temperature,
                                "stream": True, "stream_options": {"include_usage": True}}
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": spec.prompt}]
        else:
            body["prompt"] = spec.prompt
        return body | self.extra_body

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def make_http_client(max_connections: int, timeout_s: float,
                     transport: httpx.AsyncBaseTransport | None = None) -> httpx.AsyncClient:
    """`transport`: tests pass an in-process fake server here."""
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s, connect=30.0), transport=transport)


async def send(client: httpx.AsyncClient, target: Target, spec: RequestSpec, t0: float,
               scheduled_s: float) -> RequestRecord:
    """Stream one request; never raises for what the server or network does (that is the record's status)."""
    rec = RequestRecord(spec.index, spec.kind, spec.max_tokens, spec.prompt_tokens, scheduled_s)
    rec.sent_s = time.perf_counter() - t0
    try:
        async with asyncio.timeout(target.request_timeout_s):
            await _stream(client, target, spec, t0, rec)
    except TimeoutError:
        rec.status, rec.error = "timeout", f"no end within {target.request_timeout_s:.0f} s"
    except httpx.TimeoutException as exc:
        rec.status, rec.error = "timeout", f"{type(exc).__name__}: {exc}"
    except (httpx.HTTPError, OSError) as exc:
        rec.status, rec.error = "connection_error", f"{type(exc).__name__}: {exc}"
    rec.end_s = time.perf_counter() - t0
    if rec.status == "ok":
        _check_complete(rec, target.ignore_eos)
    return rec


async def _stream(client: httpx.AsyncClient, target: Target, spec: RequestSpec, t0: float, rec: RequestRecord) -> None:
    text_key = "delta" if target.endpoint == "chat" else None
    async with client.stream("POST", target.url, json=target.body(spec), headers=target.headers) as resp:
        rec.http_status = resp.status_code
        if resp.status_code != 200:
            rec.status, rec.error = "http_error", f"HTTP {resp.status_code}: {_error_message(await resp.aread())}"
            return
        chunks = 0
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                rec.done = True
                break
            try:
                event = json.loads(data)
            except ValueError:
                rec.status, rec.error = "sse_error", f"malformed event: {data[:200]}"
                return
            if "error" in event:
                rec.status, rec.error = "sse_error", _error_message(data.encode())
                return
            usage = event.get("usage")
            if usage:
                rec.usage_reported = True
                rec.output_tokens = int(usage.get("completion_tokens") or 0)
                rec.prompt_tokens = int(usage.get("prompt_tokens") or rec.prompt_tokens)
                rec.cost, rec.timing_ms = usage.get("cost"), usage.get("timing_ms")
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                rec.cached_tokens = int(cached) if cached is not None else None
                drafts = usage.get("draft_tokens")
                rec.draft_tokens = int(drafts) if drafts is not None else None
            for choice in event.get("choices") or []:
                text = (choice.get("delta") or {}).get("content") if text_key else choice.get("text")
                if text:
                    rec.token_times_s.append(time.perf_counter() - t0)
                    chunks += 1
                if choice.get("finish_reason"):
                    rec.finish_reason = choice["finish_reason"]
        if not rec.usage_reported:
            rec.output_tokens = chunks


def _check_complete(rec: RequestRecord, ignore_eos: bool) -> None:
    if not rec.done:
        rec.status, rec.error = "cut_off", f"the stream ended without [DONE] after {rec.output_tokens} tokens"
    elif not rec.token_times_s:
        rec.status, rec.error = "cut_off", "no text in the stream"
    elif ignore_eos and rec.output_tokens < rec.max_tokens and (rec.usage_reported or rec.finish_reason != "length"):
        rec.status = "cut_off"
        rec.error = f"{rec.output_tokens} of {rec.max_tokens} tokens (finish_reason {rec.finish_reason})"


def _error_message(body: bytes) -> str:
    try:
        data = json.loads(body)
        err = data.get("error", data)
        return str(err.get("message", err)) if isinstance(err, dict) else str(err)
    except (ValueError, AttributeError):
        return body.decode(errors="replace")[:300]
