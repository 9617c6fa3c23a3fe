"""One request's life on the bus.

    subscribe pd.tokens.<rid>  →  JetStream-publish the PrefillJob  →  TokenEvents until the final one

Subscribing first means no event can be published before anyone listens (both go out on the same
connection, so the server sees the SUB before the job exists). Events carry `index`, the position of
their first token in the output, so the channel drops what it has already seen and treats a jump
forward as a broken stream:

    seen = 5      event(index=3, ids=[a b c d])  →  a b are duplicates, c d are new (index 5, 6)
                  event(index=7, ...)            →  gap: tokens 5, 6 were lost → error

Every way out that is not a final event (client gone, inactivity or deadline timeout, a gap, a
publish that failed) publishes a Cancel on pd.cancel.<rid>, so workers drop the request and free its
blocks. Nothing waits forever: each wait is bounded by the inactivity timeout and the deadline.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg as NatsMsg
from nats.errors import Error as NatsError
from nats.js import JetStreamContext

from services.gateway.config import GatewayConfig
from services.gateway.errors import service_unavailable
from shared.protocol import subjects
from shared.protocol.messages import Cancel, ErrorCode, PrefillJob, SamplingMsg, TokenEvent, decode, encode

log = logging.getLogger(__name__)

_WAKE = object()  # queued by abort() so a waiting consumer looks at the abort flag at once


class StreamError(Exception):
    """The request ended without a clean final event (timeout, gap): code + message, as on the wire."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class RequestChannel:
    """The TokenEvents of one request, deduplicated and in order, with bounded waits."""

    def __init__(self, nc: NATS, request_id: str, *, inactivity_timeout_s: float, deadline_s: float) -> None:
        self.request_id = request_id
        self._nc = nc
        self._queue: asyncio.Queue = asyncio.Queue()
        self._sub = None
        self._inactivity_timeout_s = inactivity_timeout_s
        self._deadline = time.monotonic() + deadline_s
        self._deadline_s = deadline_s
        self._seen = 0  # output tokens received so far = the index the next new token must have
        self._finished = False  # a final event arrived: the workers are done with the request
        self._abort_reason: str | None = None
        self._closed = False

    @property
    def num_tokens(self) -> int:
        return self._seen

    async def subscribe(self) -> None:
        self._sub = await self._nc.subscribe(subjects.tokens(self.request_id), cb=self._on_message)

    async def _on_message(self, msg: NatsMsg) -> None:
        try:
            event = decode(msg.data, TokenEvent)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("request %s: undecodable TokenEvent dropped: %s", self.request_id, exc)
            return
        if event.request_id != self.request_id:
            log.warning("request %s: event for %s on its subject dropped", self.request_id, event.request_id)
            return
        self._queue.put_nowait(event)

    def abort(self, reason: str) -> None:
        """Stop consuming (e.g. the client went away); `close()` then publishes the Cancel.
        Synchronous, so a disconnect callback can call it."""
        if self._abort_reason is None and not self._finished:
            self._abort_reason = reason
            self._queue.put_nowait(_WAKE)

    @property
    def aborted(self) -> bool:
        return self._abort_reason is not None

    async def events(self) -> AsyncIterator[TokenEvent]:
        """New tokens only (`index` rewritten to the first new one); ends after the final event, or
        silently after `abort()`; raises StreamError on a timeout or a gap."""
        while not self._finished and self._abort_reason is None:
            item = await self._next()
            if item is _WAKE:
                continue
            event: TokenEvent = item
            if event.index > self._seen:
                raise StreamError(ErrorCode.INTERNAL, f"token stream broken: expected token {self._seen}, "
                                                      f"got an event starting at {event.index}")
            new_ids = event.token_ids[self._seen - event.index:]
            if not new_ids and not event.finished:
                continue  # a duplicate (e.g. redelivered after a worker restart)
            if event.index != self._seen or len(new_ids) != len(event.token_ids):
                event = msgspec.structs.replace(event, index=self._seen, token_ids=new_ids)
            self._seen += len(new_ids)
            self._finished = event.finished
            yield event

    async def _next(self) -> object:
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise StreamError(ErrorCode.TIMEOUT, f"request exceeded its {self._deadline_s:g} s deadline")
        try:
            return await asyncio.wait_for(self._queue.get(), min(self._inactivity_timeout_s, remaining))
        except TimeoutError:
            if time.monotonic() >= self._deadline:
                raise StreamError(ErrorCode.TIMEOUT, f"request exceeded its {self._deadline_s:g} s deadline") from None
            raise StreamError(ErrorCode.TIMEOUT, f"no tokens from the workers for {self._inactivity_timeout_s:g} s"
                              ) from None

    async def close(self, reason: str = "gateway stopped the request") -> None:
        """Unsubscribe; Cancel the request unless the workers already finished it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if not self._finished:
                cancel = Cancel(request_id=self.request_id, reason=self._abort_reason or reason)
                await self._nc.publish(subjects.cancel(self.request_id), encode(cancel))
                log.info("request %s cancelled: %s", self.request_id, cancel.reason)
            if self._sub is not None:
                await self._sub.unsubscribe()
        except NatsError as exc:  # the connection is gone: workers' deadlines still bound the request
            log.warning("request %s: could not cancel/unsubscribe: %s", self.request_id, exc)


class Dispatcher:
    """Routes jobs to a work queue by mode and opens a channel per request."""

    def __init__(self, nc: NATS, js: JetStreamContext, config: GatewayConfig) -> None:
        self._nc = nc
        self._js = js
        self._config = config

    def route(self, num_prompt_tokens: int) -> str:
        """conditional: short prompts go straight to a decode worker, which prefills them itself."""
        if self._config.mode == "conditional" and num_prompt_tokens < self._config.conditional_threshold:
            return subjects.DECODE_DIRECT
        return subjects.PREFILL_JOBS

    async def open(self, request_id: str, prompt_ids: list[int], params: SamplingMsg) -> RequestChannel:
        cfg = self._config
        channel = RequestChannel(self._nc, request_id, inactivity_timeout_s=cfg.inactivity_timeout_s,
                                 deadline_s=cfg.request_timeout_s)
        now = time.time()
        job = PrefillJob(request_id=request_id, prompt_ids=prompt_ids, params=params, created_at=now,
                         deadline=now + cfg.request_timeout_s)
        try:
            await channel.subscribe()  # first: no event can slip past us
            await self._js.publish(self.route(len(prompt_ids)), encode(job), timeout=cfg.publish_timeout_s)
        except (NatsError, TimeoutError) as exc:
            log.warning("request %s: could not publish the job: %s", request_id, exc)
            await channel.close("the job could not be published")
            raise service_unavailable(f"the job queue is unavailable ({type(exc).__name__}); retry shortly",
                                      code="queue_unavailable") from None
        return channel
