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
from services.gateway.responses import (SSE_DONE, ResponseMeta, full_response, role_chunk, sse, text_chunk,
                                        usage_chunk)
from shared.protocol.messages import Usage

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


async def sse_body(generation: Generation, meta: ResponseMeta, include_usage: bool) -> AsyncIterator[bytes]:
    """role chunk (chat) → text chunks → finish chunk → [usage chunk] → [DONE]; an error mid-way is
    sent as `data: {"error": ...}` followed by [DONE]. Closing the generation is always the last act."""
    try:
        if meta.kind == "chat":
            yield sse(role_chunk(meta))
        elif meta.echo:
            yield sse(text_chunk(meta, meta.echo))
        try:
            async with aclosing(generation.steps()) as steps:
                async for step in steps:
                    so_far = generation.usage_so_far() if meta.continuous_usage else None
                    for chunk in _step_chunks(meta, step, include_usage, so_far):
                        yield sse(chunk)
        except APIError as exc:
            yield sse(exc.body())
        if not generation.channel.aborted:
            yield SSE_DONE
    finally:
        await generation.close()


def _step_chunks(meta: ResponseMeta, step: Step, include_usage: bool, so_far: Usage | None) -> list[dict]:
    chunks = []
    logprobs = meta.logprobs.format(step.logprobs) if meta.logprobs is not None else None
    if step.text:
        chunks.append(text_chunk(meta, step.text, logprobs=logprobs, usage=so_far))
        logprobs = None
    if step.finish_reason is not None:  # with the log-probabilities of tokens that made no text (EOS)
        chunks.append(text_chunk(meta, "", step.finish_reason, step.stop_reason, logprobs=logprobs,
                                 usage=step.usage if meta.continuous_usage else None))
        if include_usage and step.usage is not None:
            chunks.append(usage_chunk(meta, step.usage))
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


async def collect(generation: Generation, meta: ResponseMeta, receive: Receive) -> Response:
    """Non-streaming: join the steps into one body; errors propagate as APIError (→ HTTP status)."""
    watcher = watch_disconnect(receive, lambda: generation.channel.abort(CLIENT_GONE))
    try:
        texts: list[str] = []
        logprobs: list[dict | None] = []
        final: Step | None = None
        async with aclosing(generation.steps()) as steps:
            async for step in steps:
                texts.append(step.text)
                if meta.logprobs is not None:
                    logprobs.append(meta.logprobs.format(step.logprobs))
                if step.finish_reason is not None:
                    final = step
        if final is None or final.usage is None:  # the client left: nobody reads this
            return Response(status_code=499)
        return JSONResponse(full_response(meta, "".join(texts), final.finish_reason, final.stop_reason, final.usage,
                                          lp.join(logprobs)))
    finally:
        watcher.cancel()
        await generation.close()
