"""Delivering a generation: as Server-Sent Events, or as one JSON body — either way watching for the
client leaving, because a client that is gone must cost the workers nothing more.

The disconnect is noticed while we wait for tokens, not only when a write fails: a task reads the
ASGI `receive` channel (after the body was read, the next message there is `http.disconnect`) and
aborts the request's channel, which wakes the consumer; closing the generation publishes the Cancel.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from services.gateway import logprobs as lp
from services.gateway.errors import APIError
from services.gateway.generation import Generation, Step
from services.gateway.responses import (SSE_DONE, ChoiceResult, ResponseMeta, finish_reason_of, full_response,
                                        role_chunk, sse, text_chunk, tool_chunk, total_usage, usage_chunk)
from services.gateway.tools import ToolCallParser
from shared.protocol.messages import Timing, Usage

log = logging.getLogger(__name__)

CLIENT_GONE = "client disconnected"


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def watch_disconnect(receive: Receive, on_disconnect: Callable[[], None]) -> asyncio.Task:
    """A task that calls `on_disconnect` once the client has gone; cancel it when done."""
    task = asyncio.create_task(_wait_for_disconnect(receive))

    def done(t: asyncio.Task) -> None:
        if not t.cancelled() and t.exception() is None:
            on_disconnect()

    task.add_done_callback(done)
    return task


async def sse_body(generations: list[Generation], meta: ResponseMeta, include_usage: bool) -> AsyncIterator[bytes]:
    """role chunk (chat) → text chunks → finish chunk → [usage chunk] → [DONE]; with n > 1 the
    choices' chunks interleave as their tokens come, each with its `index`, and the usage chunk
    follows the last choice's end. An error mid-way is sent as `data: {"error": ...}` followed by
    [DONE]. Closing the generations is always the last act."""
    formats = _formats(meta, len(generations))
    parsers = [meta.tools.parser() if meta.tools is not None else None for _ in generations]
    usages: list[Usage | None] = [None] * len(generations)  # each choice's final usage, once it has ended
    timings: list[Timing] = [Timing()] * len(generations)
    reasons: list[str] = []
    error: str | None = None
    echo_later = bool(meta.echo) and meta.logprobs is not None  # with the prompt's log-probabilities
    try:
        for g in generations:
            if meta.kind == "chat":
                yield sse(role_chunk(meta, g.index))
            elif meta.echo and not echo_later:
                yield sse(text_chunk(meta, meta.echo, index=g.index))
        echoed: set[int] = set()
        try:
            async for g, step in _interleave(generations):
                if echo_later and g.index not in echoed:  # the prompt's log-probabilities came with token 0
                    echoed.add(g.index)
                    yield sse(text_chunk(meta, meta.echo, logprobs=_echo_logprobs(formats[g.index], g),
                                         index=g.index))
                if step.usage is not None:
                    usages[g.index] = step.usage
                if step.timing is not None:
                    timings[g.index] = step.timing
                if step.finish_reason is not None:
                    reasons.append(step.finish_reason)
                so_far = _usage_so_far(generations, usages) if meta.continuous_usage else None
                for chunk in _step_chunks(meta, g.index, formats[g.index], step, so_far, parsers[g.index]):
                    yield sse(chunk)
            if include_usage and all(u is not None for u in usages):
                yield sse(usage_chunk(meta, total_usage(usages), timings))
        except APIError as exc:
            error = exc.message
            yield sse(exc.body())
        if not any(g.channel.aborted for g in generations):
            yield SSE_DONE
        elif error is None:
            error = "the client disconnected"
    finally:
        await _close_all(generations)
        _finish_trace(meta, generations, usages, reasons, timings, error)


def _finish_trace(meta: ResponseMeta, generations: list[Generation], usages: list[Usage | None], reasons: list[str],
                  timings: list[Timing], error: str | None) -> None:
    if meta.trace is None:
        return
    done = [u for u in usages if u is not None]
    if error is None and len(done) < len(generations):
        error = "the response ended early"
    meta.trace.finish(total_usage(done) if done else None, reasons, timings, error=error,
                      attempts=max(g.channel.migrations for g in generations))


def _formats(meta: ResponseMeta, n: int) -> list[lp.LogprobFormat | None]:
    if meta.logprobs is None:
        return [None] * n
    return [meta.logprobs] + [meta.logprobs.fresh() for _ in range(n - 1)]


def _echo_logprobs(formatter: lp.LogprobFormat, g: Generation) -> dict:
    return formatter.format_prompt(g.output.prompt_ids, g.prompt_logprobs or [])


def _usage_so_far(generations: list[Generation], usages: list[Usage | None]) -> Usage:
    return total_usage([u if u is not None else g.usage_so_far() for g, u in zip(generations, usages)])


async def _interleave(generations: list[Generation]) -> AsyncIterator[tuple[Generation, Step]]:
    """Every choice's steps as they come (a task per choice); the first error ends them all."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(g: Generation) -> None:
        try:
            async with aclosing(g.steps()) as steps:
                async for step in steps:
                    queue.put_nowait((g, step))
            queue.put_nowait((g, done))
        except Exception as exc:  # an APIError, or a bug: either way the consumer must hear of it
            queue.put_nowait((g, exc))

    tasks = [asyncio.create_task(pump(g)) for g in generations]
    try:
        running = len(tasks)
        while running:
            g, item = await queue.get()
            if item is done:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield g, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _close_all(generations: list[Generation]) -> None:
    await asyncio.gather(*(g.close() for g in generations))


def _step_chunks(meta: ResponseMeta, index: int, formatter: lp.LogprobFormat | None, step: Step,
                 so_far: Usage | None, parser: ToolCallParser | None = None) -> list[dict]:
    """A step's chunks: its text (with tools: the content outside tool calls, and each call as it
    is complete), then the finish; log-probabilities ride on the first chunk."""
    chunks = []
    logprobs = formatter.format(step.logprobs) if formatter is not None else None
    text, calls = parser.push(step.text) if parser is not None else (step.text, [])
    if step.finish_reason is not None and parser is not None:
        rest, more = parser.finish()
        text, calls = text + rest, calls + more
    if text:
        chunks.append(text_chunk(meta, text, logprobs=logprobs, usage=so_far, index=index))
        logprobs = None
    if calls:
        chunks.append(tool_chunk(meta, calls, logprobs=logprobs, usage=so_far, index=index))
        logprobs = None
    if step.finish_reason is not None:  # with the log-probabilities of tokens that made no text (EOS)
        reason = finish_reason_of(step.finish_reason, bool(parser is not None and parser.calls))
        chunks.append(text_chunk(meta, "", reason, step.stop_reason, logprobs=logprobs, usage=so_far, index=index))
    elif logprobs is not None and parser is not None:  # text held back (a tool call forming): not its log-probs
        chunks.append(text_chunk(meta, "", logprobs=logprobs, usage=so_far, index=index))
    return chunks


class SSEResponse(StreamingResponse):
    """text/event-stream that aborts the request as soon as the client disconnects."""

    def __init__(self, body: AsyncIterator[bytes], on_disconnect: Callable[[], None]) -> None:
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_disconnect = on_disconnect

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gone = False

        def client_gone() -> None:
            nonlocal gone
            if not gone:
                gone = True
                self._on_disconnect()

        watcher = watch_disconnect(receive, client_gone)
        body = self.body_iterator
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in body:
                if gone:
                    break
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if not gone:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the write failed: the client is gone
            client_gone()
        finally:
            watcher.cancel()
            await body.aclose()  # runs sse_body's finally: Cancel + slot release


async def collect(generations: list[Generation], meta: ResponseMeta, receive: Receive, num_choices: int,
                  strip_logprobs: bool = False) -> Response:
    """Non-streaming: join each choice's steps into one body; with best_of > n, the n choices of the
    highest mean token log-probability. Errors propagate as APIError (→ HTTP status)."""
    watcher = watch_disconnect(receive, lambda: [g.channel.abort(CLIENT_GONE) for g in generations])
    formats = _formats(meta, len(generations))
    error: str | None = None
    texts: list[list[str]] = [[] for _ in generations]
    logprobs: list[list[dict | None]] = [[] for _ in generations]
    finals: list[Step | None] = [None] * len(generations)
    try:
        async for g, step in _interleave(generations):
            texts[g.index].append(step.text)
            if meta.echo and formats[g.index] is not None and not logprobs[g.index]:
                logprobs[g.index].append(_echo_logprobs(formats[g.index], g))
            if formats[g.index] is not None:
                logprobs[g.index].append(formats[g.index].format(step.logprobs))
            if step.finish_reason is not None:
                finals[g.index] = step
        if any(f is None or f.usage is None for f in finals):  # the client left: nobody reads this
            error = "the client disconnected"
            return Response(status_code=499)
        results = [ChoiceResult("".join(t), f.finish_reason, f.stop_reason, f.usage, lp.join(parts),
                                f.timing or Timing()) for t, f, parts in zip(texts, finals, logprobs)]
        usage = total_usage([r.usage for r in results])
        timings = [r.timing for r in results]  # before best_of drops candidates: they were computed too
        if len(results) > num_choices:
            results = sorted(results, key=_mean_logprob, reverse=True)[:num_choices]
        if strip_logprobs:
            for r in results:
                r.logprobs = None
        return JSONResponse(full_response(meta, results, usage, timings))
    except APIError as exc:
        error = exc.message
        raise
    finally:
        watcher.cancel()
        await _close_all(generations)
        ended = [f for f in finals if f is not None]
        _finish_trace(meta, generations, [f.usage if f is not None else None for f in finals],
                      [f.finish_reason for f in ended], [f.timing or Timing() for f in ended] or [Timing()], error)


def _mean_logprob(choice: ChoiceResult) -> float:
    """OpenAI's best_of ranking: log-probability per token (a choice without tokens ranks last)."""
    values = (choice.logprobs or {}).get("token_logprobs") or []
    return sum(values) / len(values) if values else float("-inf")
