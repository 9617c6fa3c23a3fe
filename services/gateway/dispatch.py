"""One request's life on the bus.

    subscribe pd.tokens.<rid>  →  JetStream-publish the PrefillJob  →  TokenEvents until the final one

Subscribing first means no event can be published before anyone listens (both go out on the same
connection, so the server sees the SUB before the job exists). Events carry `index`, the position of
their first token in the output, so the channel drops what it has already seen and treats a jump
forward as a broken stream:

    seen = 5      event(index=3, ids=[a b c d])  →  a b are duplicates, c d are new (index 5, 6)
                  event(index=7, ...)            →  gap: tokens 5, 6 were lost → resubmit after
                                                    token 4 (a migration), or error

Every way out that is not a final event (client gone, inactivity or deadline timeout, a gap, a
publish that failed) publishes a Cancel on pd.cancel.<rid>, so workers drop the request and free its
blocks. Nothing waits forever: each wait is bounded by the inactivity timeout (a job waiting in a
queue: the queue timeout) and the deadline.
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
from services.gateway.router import Router
from shared.protocol import subjects
from shared.transport import nats_bus
from shared.protocol.messages import Cancel, ErrorCode, PrefillJob, SamplingMsg, TokenEvent, decode, encode

log = logging.getLogger(__name__)

_WAKE = object()  # queued by abort() so a waiting consumer looks at the abort flag at once


class StreamError(Exception):
    """The request ended without a clean final event (timeout, gap): code + message, as on the wire."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


# the roles whose workers take jobs from each queue (the shared one and the workers' own subjects in it)
TAKERS = {subjects.PREFILL_JOBS: ("prefill", "colocated"), subjects.DECODE_DIRECT: ("decode",),
          subjects.DECODE_JOBS: ("decode",)}


class RequestChannel:
    """The TokenEvents of one request, deduplicated and in order, with bounded waits.

    Migration: when the worker that streamed the last tokens stops heartbeating (`silent_for` its
    instance > worker_dead_s) the request is resubmitted through `resubmit(tokens_so_far, attempt)`
    — prompt + the tokens already streamed, which the prefix cache makes cheap — and the stream goes
    on from the next index, so the client sees neither a gap nor a duplicate. The replaced attempt is
    cancelled (a hung worker may wake up) and its late events are dropped. After `max_migrations` it
    ends with WORKER_LOST. Watched: the decode-side worker holding the request (a decode worker
    announces a job it takes with an empty event), and before that the worker the router sent the
    job to (`routed`: its own subject has no one else to redeliver to) until it hands the job to the
    decode queue. A dead prefill worker's unacked job from the shared queue is redelivered by
    JetStream instead.

    Timeouts: while a job waits in a queue — before a worker takes it, and between prefill and
    decode (the prefill worker's `queued` notice) — the request waits up to `queue_timeout_s`, so a
    busy pool makes it wait rather than fail; otherwise `inactivity_timeout_s` without an event
    ends it. Queued where no worker that takes from that queue heartbeats (`live(role)` false for
    each of their roles), nobody will take it: the inactivity timeout applies again."""

    def __init__(self, nc: NATS, request_id: str, *, inactivity_timeout_s: float, deadline_s: float,
                 queue_timeout_s: float | None = None, resubmit=None, withdraw=None, silent_for=None, role_of=None,
                 live=None, max_migrations: int = 0, worker_dead_s: float = 3.0, on_close=None) -> None:
        self.request_id = request_id
        self._on_close = on_close  # called once with this channel when it closes (the open-channel registry)
        self._resubmit, self._silent_for, self._role_of, self._live = resubmit, silent_for, role_of, live
        # `await withdraw()` deletes the current attempt's job message if it is still in its queue: a
        # worker that never heard the Cancel (one restarted on its own subject) must not run it
        self._withdraw = withdraw
        self._max_migrations, self._worker_dead_s = max_migrations, worker_dead_s
        self.migrations = 0  # = the attempt now running; events of earlier attempts are dropped
        self._token_ids: list[int] = []  # every output token so far (what a migration resumes after)
        self._worker = ""  # the decode-side instance holding the request (from its events)
        self._last_event = time.monotonic()
        self._nc = nc
        self._queue: asyncio.Queue = asyncio.Queue()
        self._sub = None
        self._inactivity_timeout_s = inactivity_timeout_s
        # until a worker takes the current attempt's job (its first event), the job is queued: it may
        # wait queue_timeout_s (while NATS is up) instead of the inactivity timeout
        self._queue_timeout_s = max(inactivity_timeout_s, queue_timeout_s or 0.0)
        self._queued = True
        self._queued_for: tuple[str, ...] = ()  # the roles whose workers take the job from its queue
        self._deadline = time.monotonic() + deadline_s
        self._deadline_s = deadline_s
        self._finished = False  # a final event arrived: the workers are done with the request
        self._abort_reason: str | None = None
        self._closed = False
        # set once this request's prompt KV can be found by others: it has a second token (so a
        # decode worker holds it and the kvstore has its blocks) or it ended (n > 1 waits on it)
        self.progressed = asyncio.Event()
        self.publish_task: asyncio.Task | None = None  # a job published later (Dispatcher.open's `after`)
        self._on_taken = None  # called once when a worker takes the job (or the request ends first)

    def routed(self, target: str, on_taken) -> None:
        """The job went to worker `target`'s own subject: watch it from now on (if it dies before
        another worker has the request, the job is resubmitted to the shared queue, like a
        migration), and call `on_taken()` once it takes the job."""
        self._worker = target
        self._on_taken = on_taken

    def _taken(self) -> None:
        if self._on_taken is not None:
            on_taken, self._on_taken = self._on_taken, None
            on_taken()

    @property
    def num_tokens(self) -> int:
        return self._seen

    @property
    def _seen(self) -> int:
        """Output tokens received so far = the index the next new token must have."""
        return len(self._token_ids)

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

    @property
    def closed(self) -> bool:
        return self._closed

    def fail(self, code: ErrorCode, message: str) -> None:
        """End the stream with an error (the consumer raises StreamError at its next wait): how a
        stopping gateway ends the streams still open, so none is closed without a word."""
        if self._abort_reason is None and not self._finished and not self._closed:
            self._queue.put_nowait(StreamError(code, message))

    async def events(self) -> AsyncIterator[TokenEvent]:
        """New tokens only (`index` rewritten to the first new one); ends after the final event, or
        silently after `abort()`; raises StreamError on a timeout or a gap."""
        while not self._finished and self._abort_reason is None:
            item = await self._next()
            if item is _WAKE:
                continue
            if isinstance(item, StreamError):
                raise item
            event: TokenEvent = item
            if event.attempt < self.migrations:
                continue  # from an attempt given up on (a hung worker that woke up)
            if self._decode_side(event.worker):
                self._worker = event.worker  # a decode-side worker holds the request now: watch it
            if event.queued:
                if not self._decode_side(self._worker):
                    # handed to the decode pool's queue, where it waits for a worker with room: JetStream
                    # holds the job, not the prefill worker (a decode worker's notice may come first)
                    self._queued, self._queued_for, self._worker = True, TAKERS[subjects.DECODE_JOBS], ""
                elif event.worker == self._worker:
                    # the decode worker holding it waits for room in its KV cache (still watched)
                    self._queued, self._queued_for = True, TAKERS[subjects.DECODE_JOBS]
            if not event.token_ids and not event.finished:
                continue  # a "taken" or "queued" notice, or a duplicate: nothing to stream
            if event.index > self._seen:  # events were lost (e.g. NATS restarted): resume after what we have
                await self._migrate(f"token stream broken: expected token {self._seen}, "
                                    f"got an event starting at {event.index}", ErrorCode.INTERNAL)
                continue
            new_ids = event.token_ids[self._seen - event.index:]
            if not new_ids and not event.finished:
                continue  # a duplicate (e.g. redelivered after a worker restart)
            if event.index != self._seen or len(new_ids) != len(event.token_ids):
                event = msgspec.structs.replace(event, index=self._seen, token_ids=new_ids,
                                                logprobs=event.logprobs[self._seen - event.index:])
            self._token_ids += new_ids
            self._finished = event.finished
            if self._seen >= 2 or event.finished:
                self.progressed.set()
            yield event

    def waits_in(self, subject: str) -> None:
        """The current attempt's job was published on `subject` (a shared queue, or a worker's own)."""
        self._queued_for = next(roles for base, roles in TAKERS.items() if subject.startswith(base))

    def _decode_side(self, worker: str) -> bool:
        return bool(worker) and self._role_of is not None and self._role_of(worker) in ("decode", "colocated")

    async def _next(self) -> object:
        while True:
            now = time.monotonic()
            remaining = self._deadline - now
            if remaining <= 0:
                raise StreamError(ErrorCode.TIMEOUT, f"request exceeded its {self._deadline_s:g} s deadline")
            idle = now - self._last_event
            connected = self._nc.is_connected
            orphaned = (self._queued and self._queued_for and self._live is not None
                        and not any(self._live(role) for role in self._queued_for))
            limit = self._queue_timeout_s if self._queued and connected and not orphaned else self._inactivity_timeout_s
            if idle >= limit:
                if not connected:  # say why: the bus is down, not the workers slow
                    raise StreamError(ErrorCode.UNAVAILABLE, f"no tokens from the workers for "
                                      f"{self._inactivity_timeout_s:g} s: the gateway lost its connection to NATS")
                if orphaned:
                    raise StreamError(ErrorCode.UNAVAILABLE, f"no tokens from the workers for {limit:g} s: the "
                                      f"request waits for a {' or '.join(self._queued_for)} worker and none is alive")
                if self._queued:
                    raise StreamError(ErrorCode.TIMEOUT, f"no worker took the request within {limit:g} s")
                raise StreamError(ErrorCode.TIMEOUT, f"no tokens from the workers for {self._inactivity_timeout_s:g} s")
            wait = min(remaining, limit - idle, 1.0)  # wake every second to check
            try:
                item = await asyncio.wait_for(self._queue.get(), wait)
                self._last_event = time.monotonic()
                if isinstance(item, TokenEvent) and item.attempt >= self.migrations:
                    self._queued = False  # a worker has the job (a "taken" notice or tokens)
                    self._taken()
                return item
            except TimeoutError:
                await self._migrate_if_worker_died()

    async def _migrate_if_worker_died(self) -> None:
        if (self._silent_for is None or self._finished or not self._worker
                or self._silent_for(self._worker) < self._worker_dead_s):
            return
        await self._migrate(f"worker {self._worker} died while streaming this request", ErrorCode.WORKER_LOST)

    async def _migrate(self, why: str, code: ErrorCode) -> None:
        """Resubmit prompt + the tokens so far as the next attempt, or fail with `code` once
        `max_migrations` are used up."""
        if self._resubmit is None or self.migrations >= self._max_migrations:
            raise StreamError(code, f"{why} (after {self.migrations} migrations)")
        # the attempt given up on may still be running (a hung worker wakes up, a stream that lost
        # events): cancel it so it frees its blocks
        cancel = Cancel(request_id=self.request_id, reason=f"migrated: {why}", attempt=self.migrations)
        await self._nc.publish(subjects.cancel(self.request_id), encode(cancel))
        if self._withdraw is not None:
            await self._withdraw()
        self.migrations += 1
        self._worker, self._queued_for = "", ()
        self._queued = True  # the resubmitted job waits in the queue again
        log.warning("request %s: %s after %d tokens; resubmitting (migration %d)",
                    self.request_id, why, self._seen, self.migrations)
        try:
            await self._resubmit(list(self._token_ids), self.migrations)
        except (NatsError, TimeoutError) as exc:
            raise StreamError(code, f"{why}; resubmitting failed ({type(exc).__name__})") from None
        self._last_event = time.monotonic()

    async def close(self, reason: str = "gateway stopped the request") -> None:
        """Unsubscribe; Cancel the request unless the workers already finished it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.progressed.set()
        self._taken()
        if self.publish_task is not None:
            self.publish_task.cancel()  # the job may not be out yet; the Cancel below covers it if it is
        if self._on_close is not None:
            self._on_close(self)
        try:
            if not self._finished:
                cancel = Cancel(request_id=self.request_id, reason=self._abort_reason or reason)
                await self._nc.publish(subjects.cancel(self.request_id), encode(cancel))
                if self._withdraw is not None:
                    await self._withdraw()
                log.info("request %s cancelled: %s", self.request_id, cancel.reason)
            if self._sub is not None:
                await self._sub.unsubscribe()
        except NatsError as exc:  # the connection is gone: workers' deadlines still bound the request
            log.warning("request %s: could not cancel/unsubscribe: %s", self.request_id, exc)


class Dispatcher:
    """Routes jobs to a work queue by mode and opens a channel per request."""

    def __init__(self, nc: NATS, js: JetStreamContext, config: GatewayConfig, workers=None,
                 router: Router | None = None, on_route=None) -> None:
        self._nc = nc
        self._js = js
        self._config = config
        self._workers = workers  # WorkerView: who is alive (for migration)
        self.router = router  # None: every job to its pool's shared queue
        self._on_route = on_route  # called with each Route taken (metrics)
        self.channels: set[RequestChannel] = set()  # open ones: a stopping gateway ends them
        self._idle = asyncio.Event()  # set while no channel is open
        self._idle.set()

    def _opened(self, channel: RequestChannel) -> None:
        self.channels.add(channel)
        self._idle.clear()

    def _closed(self, channel: RequestChannel) -> None:
        self.channels.discard(channel)
        if not self.channels:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """Until no channel is open (True) or `timeout` seconds have passed (False)."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    def end_all(self, code: ErrorCode, message: str) -> int:
        """Fail every open channel (see RequestChannel.fail); returns how many."""
        for channel in list(self.channels):
            channel.fail(code, message)
        return len(self.channels)

    def route(self, prompt_ids: list[int], channel: RequestChannel) -> str:
        """The subject of this request's job (router.py); a job for one worker's own subject has the
        channel watch that worker."""
        if self.router is None:
            return subjects.PREFILL_JOBS
        route = self.router.route(prompt_ids)
        if route.target:
            channel.routed(route.target, lambda: self.router.taken(route))
        if self._on_route is not None:
            self._on_route(route)
        return route.subject

    async def open(self, request_id: str, prompt_ids: list[int], params: SamplingMsg,
                   after: RequestChannel | None = None, headers: dict[str, str] | None = None) -> RequestChannel:
        """Subscribe, then publish the job — or, with `after` (another choice of the same prompt,
        n > 1), publish it once that one has `progressed`, so its prompt blocks are in the prefix
        cache and this job computes only the prompt's last, partial block. `headers`: the trace
        context every attempt of the job carries (a migration continues the same trace)."""
        cfg = self._config
        now = time.time()
        job = PrefillJob(request_id=request_id, prompt_ids=prompt_ids, params=params, created_at=now,
                         deadline=now + cfg.request_timeout_s)

        queued: list = []  # where the current attempt's job message is: [(stream, seq)]

        async def publish(subject: str, message: PrefillJob) -> None:
            ack = await nats_bus.publish_job(self._js, subject, encode(message), f"{message.request_id}.{message.attempt}",
                                             timeout=cfg.publish_timeout_s, headers=headers)
            queued[:] = [(ack.stream, ack.seq)]
            channel.waits_in(subject)  # (defined below, before any publish)

        async def resubmit(resume_ids: list[int], attempt: int) -> None:
            again = msgspec.structs.replace(job, resume_ids=resume_ids, attempt=attempt, created_at=time.time())
            # through the prefill queue in every mode: prompt + resumed tokens is a long prompt
            await publish(subjects.PREFILL_JOBS, again)

        async def withdraw() -> None:
            if not queued:
                return
            (stream, seq), queued[:] = queued[0], []
            try:  # taken and acked already: a work queue has deleted it ("no message found")
                await asyncio.wait_for(self._js.delete_msg(stream, seq), cfg.publish_timeout_s)
            except (NatsError, TimeoutError):
                pass  # (NATS away: a worker that missed the Cancel still skips the job past its deadline)

        channel = RequestChannel(
            self._nc, request_id, inactivity_timeout_s=cfg.inactivity_timeout_s, deadline_s=cfg.request_timeout_s,
            queue_timeout_s=cfg.queue_timeout_s,
            resubmit=resubmit, withdraw=withdraw, silent_for=self._workers.silent_for if self._workers is not None else None,
            role_of=self._workers.role_of if self._workers is not None else None,
            live=(lambda role: bool(self._workers.live(role))) if self._workers is not None else None,
            max_migrations=cfg.max_migrations, worker_dead_s=cfg.worker_dead_s, on_close=self._closed)
        self._opened(channel)
        try:
            await channel.subscribe()  # first: no event can slip past us
            if after is None:
                await publish(self.route(prompt_ids, channel), job)
        except (NatsError, TimeoutError) as exc:
            log.warning("request %s: could not publish the job: %s", request_id, exc)
            await channel.close("the job could not be published")
            raise service_unavailable(f"the job queue is unavailable ({type(exc).__name__}); retry shortly",
                                      code="queue_unavailable") from None
        if after is not None:
            channel.publish_task = asyncio.create_task(self._publish_after(channel, after, job, publish))
        return channel

    async def _publish_after(self, channel: RequestChannel, after: RequestChannel, job: PrefillJob, publish) -> None:
        await after.progressed.wait()
        if channel.aborted or channel.closed:
            return
        job = msgspec.structs.replace(job, created_at=time.time())
        try:
            await publish(self.route(job.prompt_ids, channel), job)  # now: the prompt is cached somewhere
        except (NatsError, TimeoutError) as exc:
            log.warning("request %s: could not publish the job: %s", job.request_id, exc)
            channel.fail(ErrorCode.UNAVAILABLE, f"the job queue is unavailable ({type(exc).__name__}); retry shortly")
