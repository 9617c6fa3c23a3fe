"""What every engine worker (prefill, decode, colocated) shares: connections, heartbeat, the cancel
listener, and publishing token events. The services add their own job loops on top."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable

from shared.config import WorkerConfig
import torch

from shared.engine.async_engine import AsyncEngine, RequestStream, StreamItem
from shared.engine.cores import CoreShare
from shared.engine.engine import LLMEngine
from shared.protocol import subjects
from shared.protocol.convert import logprobs_msg, to_params
from shared.protocol.messages import (Cancel, DecodeJob, ErrorCode, ResetReply, Timing, TokenEvent, Usage, WorkerStats,
                                     decode, encode)
from shared.transport import nats_bus, valkey
from shared.transport.cache_events import CachePublisher
from shared.transport.heartbeat import heartbeat, publish_stats
from shared.transport.kv_client import KVStoreClient, KVStoreError

log = logging.getLogger(__name__)
REPLAY_WINDOW_S = 10.0  # token events kept to send again after an outage
REPLAY_MARGIN_S = 2.0  # before a disconnect: what may have been in flight on the dying connection


class CancelledSet:
    """Requests cancelled recently (a cancel may arrive before the job does), each with the last
    attempt the cancel covers (-1: every attempt): bounded, FIFO."""

    def __init__(self, capacity: int = 100_000):
        self._ids: OrderedDict[str, int] = OrderedDict()
        self.capacity = capacity

    def add(self, request_id: str, attempt: int = -1) -> None:
        known = self._ids.get(request_id)
        self._ids[request_id] = -1 if attempt < 0 or known == -1 else max(attempt, known or 0)
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)

    def covers(self, request_id: str, attempt: int) -> bool:
        last = self._ids.get(request_id)
        return last is not None and (last < 0 or attempt <= last)


class WorkerRuntime:
    def __init__(self, config: WorkerConfig, engine: LLMEngine):
        self.config = config
        self.engine = engine
        cores = None
        if config.core_share:
            cores = CoreShare(config.core_share, config.core_slot,
                              None if config.core_fair else engine.config.num_threads or torch.get_num_threads())
        # a decode step of one sequence is short and runs beside the gateway and NATS: a team of
        # borrowed threads loses more to being descheduled at its barriers than it gains (measured)
        self.async_engine = AsyncEngine(engine, cores, borrow_from=1 if config.role == "prefill" else 2)
        self.cancelled = CancelledSet()
        self.attempts: dict[str, int] = {}  # request id → the attempt of it this worker holds
        self.nc = None
        self.js = None
        self.redis = None
        self.stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.cache_events: CachePublisher | None = None
        self._queued = 0
        self.draining = False  # SIGTERM: no new jobs; the stats say so (the routers send none)
        # the token events of the last REPLAY_WINDOW_S, sent again after a NATS outage (replay_recent)
        self._recent: deque[tuple[float, str, bytes]] = deque()
        self._disconnected_at: float | None = None

    async def start(self) -> None:
        c = self.config
        self.nc = await nats_bus.connect(c.nats_url, f"{c.role}-{c.instance}", user=c.nats_user,
                                         password=c.nats_password, token=c.nats_token,
                                         on_disconnected=self._on_disconnected, on_reconnected=self._on_reconnected)
        self.js = self.nc.jetstream()
        await nats_bus.ensure_streams(self.js, replicas=nats_bus.stream_replicas(self.nc))
        self.redis = valkey.connect(c.redis_url, c.redis_password)
        await self.nc.subscribe(subjects.CANCEL_ALL, cb=self._on_cancel)
        await self.nc.subscribe(subjects.RESET_PREFIX_CACHE, cb=self._on_reset)
        await self.nc.subscribe(subjects.REPLAY_TOKENS, cb=self._on_replay_request)
        self._tasks = [asyncio.create_task(self.async_engine.run(self.stop), name="engine")]
        if self.engine.config.enable_prefix_caching:  # the routing index follows this engine's prefix cache
            self.async_engine.watch_blocks()
            self.cache_events = CachePublisher(self.nc, self.redis, subjects.cache_location("worker", c.instance),
                                               self.async_engine.take_block_events, self.async_engine.cached_keys)
            await self.cache_events.start()
            self._tasks.append(asyncio.create_task(self.cache_events.run(self.stop), name="cache-events"))

    def ready(self) -> None:
        """Start heartbeating: from now on the gateway counts this worker as live (/health), so only
        once it takes jobs (its kvstore attached, its consumers subscribed)."""
        log.info("%s worker %s ready", self.config.role, self.config.instance)
        self._tasks.append(asyncio.create_task(heartbeat(self.nc, self.redis, self.stats, self.stop), name="heartbeat"))

    async def _on_cancel(self, msg) -> None:
        try:
            cancel = decode(msg.data, Cancel)
        except Exception as exc:
            log.warning("malformed cancel on %s: %s", msg.subject, exc)
            return
        rid = cancel.request_id
        self.cancelled.add(rid, cancel.attempt)
        if cancel.attempt >= 0 and self.attempts.get(rid, -1) > cancel.attempt:
            return  # a later attempt of the request is what this worker holds now
        self.async_engine.abort(rid)
        self.on_cancel(rid)

    # ---------------------------------------------------------------- token events lost in an outage
    # Core NATS drops what is in flight when a connection dies (the events written to the old socket),
    # and what is published for a subscriber that is away. A gap is seen by the gateway when the next
    # event arrives (it migrates the request), but a lost last event has no next one: the request
    # would hang until the inactivity timeout. So the events of the last seconds are sent again after
    # an outage, once interest has had time to spread through the cluster, and the gateway drops what
    # it already has.

    def _on_disconnected(self) -> None:
        if self._disconnected_at is None:
            self._disconnected_at = time.monotonic()

    def _on_reconnected(self) -> None:
        since = (self._disconnected_at or time.monotonic()) - REPLAY_MARGIN_S
        self._disconnected_at = None
        self._tasks = [t for t in self._tasks if not t.done()]
        self._tasks.append(asyncio.create_task(self.replay_recent(since, delays=nats_bus.REPLAY_DELAYS_S), name="replay"))

    async def _on_replay_request(self, msg) -> None:
        await self.replay_recent(time.monotonic() - REPLAY_WINDOW_S)

    async def replay_recent(self, since: float, delays: tuple[float, ...] = (0.0,)) -> int:
        """Publish again every token event sent since `since` (monotonic), after each delay in turn."""
        sent = 0
        for delay in delays:
            await asyncio.sleep(delay)
            again = [(subject, data) for t, subject, data in list(self._recent) if t >= since]
            for subject, data in again:
                await self.nc.publish(subject, data)
            sent += len(again)
        if sent:
            log.info("sent %d recent token events again after a NATS outage", sent)
        return sent

    async def _on_reset(self, msg) -> None:
        blocks = await self.async_engine.reset_prefix_cache()
        log.info("prefix cache reset (%d blocks forgotten)", blocks)
        if msg.reply:
            reply = ResetReply(role=self.config.role, instance=self.config.instance, blocks=blocks)
            await self.nc.publish(msg.reply, encode(reply))

    def on_cancel(self, request_id: str) -> None:
        """Services override to drop work that is not in the engine yet (e.g. a KV transfer)."""

    async def accept(self, msg, job_type, on_skip=None):
        """Decode a pulled job; a malformed one is dropped for good (term), one cancelled or past
        its deadline is acked and skipped (after `await on_skip(job)`, e.g. to free its blocks).
        Returns the job, or None when there is nothing to do."""
        try:
            job = decode(msg.data, job_type)
        except Exception as exc:
            log.error("malformed %s dropped: %s", job_type.__name__, exc)
            await msg.term()
            return None
        rid = job.request_id
        if self.cancelled.covers(rid, job.attempt) or (job.deadline and time.time() > job.deadline):
            if on_skip is not None:
                await on_skip(job)
            await msg.ack()
            return None
        if self.attempts.get(rid, -1) > job.attempt:
            # an attempt the gateway gave up on, while a later one runs here (a restarted worker finds
            # its own subject's old jobs after the gateway resubmitted them to the shared queue)
            log.info("request %s: attempt %d is superseded by attempt %d here; dropped", rid, job.attempt,
                     self.attempts[rid])
            await msg.ack()
            return None
        if self.attempts.get(rid) == job.attempt:
            # JetStream redelivered a job this worker is still running (its in_progress came late,
            # e.g. on a starved CPU): the running one acks it; a second copy would only fail
            log.info("request %s: redelivery of the job this worker is running, ignored", rid)
            return None
        if self.attempts.get(rid, job.attempt) < job.attempt:
            self.async_engine.abort(rid)  # an earlier attempt (this worker hung and was given up on)
        self.attempts[rid] = job.attempt
        return job

    def done(self, request_id: str, attempt: int) -> None:
        """The worker's part of this attempt is over (its events are published)."""
        if self.attempts.get(request_id) == attempt:
            del self.attempts[request_id]

    async def params_or_reject(self, msg, request_id: str, sampling, num_resumed: int, index: int):
        """The job's engine parameters; invalid ones end the request with BAD_REQUEST (and the job
        is acked: retrying cannot help). Returns None then."""
        try:
            return to_params(sampling, num_resumed=num_resumed)
        except ValueError as exc:
            await self.publish_error(request_id, index, ErrorCode.BAD_REQUEST, str(exc))
            await msg.ack()
            return None

    def stats(self) -> WorkerStats:
        pool = self.engine.pool
        sched = self.engine.scheduler
        spec = {}
        if self.engine.spec is not None:
            s = self.engine.spec.stats
            spec = dict(spec_drafts=s.num_drafts, spec_draft_tokens=s.num_draft_tokens,
                        spec_accepted_tokens=s.num_accepted_tokens, spec_accepted_per_pos=list(s.accepted_per_pos))
        return WorkerStats(role=self.config.role, instance=self.config.instance, running=len(sched.running),
                           waiting=len(sched.waiting), kv_blocks_total=pool.num_blocks,
                           kv_blocks_in_use=pool.num_used_blocks, kv_blocks_cached=pool.num_cached_blocks,
                           prefix_queries=self.prefix_queries, prefix_hits=self.prefix_hits,
                           free_slots=max(0, self.engine.config.max_num_seqs - self.async_engine.num_requests),
                           busy_s=self.engine.stats.busy_s, busy_core_s=self.engine.stats.busy_core_s,
                           kvstore="" if self.config.role == "colocated" else self.config.kvstore,
                           queued_tokens=self.queued_tokens(), draining=self.draining, **spec)

    def queued_tokens(self) -> int:
        """AsyncEngine.queued_tokens, read between or during steps."""
        try:
            self._queued = self.async_engine.queued_tokens()
        except RuntimeError:  # a step changed the queue while we read it: the last reading will do
            pass
        return self._queued

    async def publish_tokens(self, request_id: str, index: int, token_ids: list[int], *, logprobs=None,
                             prompt_logprobs=None, **fields) -> None:
        """`logprobs`: the engine's, one per token id (None: not asked for); `prompt_logprobs`: the
        prompt's, with the request's first tokens."""
        event = TokenEvent(request_id=request_id, index=index, token_ids=token_ids, logprobs=logprobs_msg(logprobs),
                           prompt_logprobs=logprobs_msg(prompt_logprobs), worker=self.config.instance,
                           attempt=self.attempts.get(request_id, 0), **fields)
        subject, data = subjects.tokens(request_id), encode(event)
        now = time.monotonic()
        self._recent.append((now, subject, data))
        while self._recent and self._recent[0][0] < now - REPLAY_WINDOW_S:
            self._recent.popleft()
        await self.nc.publish(subject, data)

    async def first_output(self, stream: RequestStream, index: int,
                           renew: Callable[[], Awaitable[object]] | None = None) -> StreamItem:
        """The request's first output from the engine. While it computes (a long prompt, or one that
        waits in the engine behind others: four documents at once on a slow CPU take minutes), each
        third of the ack wait or of the lease TTL (the shorter), while the engine has stepped within
        the last ack wait, the gateway gets a "taken" notice and `renew()` keeps a lease alive, so
        neither the gateway's inactivity timeout nor the lease's TTL gives up on a request this
        worker is busy on, however long one step takes. An engine that stopped stepping sends
        nothing: the gateway's timeout still ends its requests."""
        beats = asyncio.create_task(self._while_computing(stream.request_id, index, renew))
        try:
            return await stream.get()
        finally:
            beats.cancel()

    async def _while_computing(self, rid: str, index: int, renew: Callable[[], Awaitable[object]] | None) -> None:
        c = self.config
        steps, stepped_at = self.async_engine.steps, time.monotonic()
        while True:
            await asyncio.sleep(min(c.ack_wait_s, c.lease_ttl_s) / 3)
            if self.async_engine.steps != steps:
                steps, stepped_at = self.async_engine.steps, time.monotonic()
            elif time.monotonic() - stepped_at > c.ack_wait_s:
                continue
            try:
                await self.publish_tokens(rid, index, [])
            except Exception as exc:  # NATS away: the next beat tries again
                log.warning("request %s: progress notice not sent (%s)", rid, exc)
            if renew is not None:
                try:
                    await renew()
                except Exception as exc:  # storing its KV will fail too: decode recomputes it
                    log.warning("request %s: lease not renewed (%s)", rid, exc)
                    renew = None

    async def job_failed(self, msg, job_type) -> None:
        """A job raised unexpectedly (call from an `except`). Hand it back for another try (here or
        on another worker) unless this was its last delivery: then end its request with an error at
        once, instead of leaving the gateway to wait out its queue timeout for a job nobody runs."""
        delivered = msg.metadata.num_delivered
        if delivered < self.config.max_deliver:
            log.exception("%s failed unexpectedly (delivery %d of %d); it will be redelivered", job_type.__name__,
                          delivered, self.config.max_deliver)
            await safe(msg.nak(delay=1.0))
            return
        log.exception("%s failed unexpectedly on its last delivery (%d); its request fails", job_type.__name__,
                      delivered)
        try:
            job = decode(msg.data, job_type)
        except Exception:  # cannot name its request: JetStream drops it, the gateway's timeout ends it
            job = None
        if job is not None:
            # the index the worker would have published next: the gateway drops events behind its stream
            index = job.num_resumed + 1 if isinstance(job, DecodeJob) else len(job.resume_ids)
            await safe(self.publish_error(job.request_id, index, ErrorCode.INTERNAL,
                                          f"{self.config.role} worker {self.config.instance} failed this request's "
                                          f"job {delivered} times (see its log)"))
        await safe(msg.term())

    async def publish_error(self, request_id: str, index: int, code: ErrorCode, message: str) -> None:
        log.warning("request %s fails: %s", request_id, message)
        await self.publish_tokens(request_id, index, [], finished=True, finish_reason="error", error_code=code,
                                  error=message)

    async def report_load(self) -> None:
        """Publish stats now, ahead of the event that ends a request's work here: the gateway's router
        then never judges this worker by a load reading taken while that work was still running."""
        await publish_stats(self.nc, self.stats())

    async def publish_final(self, request_id: str, index: int, token_ids: list[int], *, finish_reason: str,
                            stop_reason, prompt_tokens: int, completion_tokens: int, cached_tokens: int,
                            timing: Timing | None, draft_tokens: int = 0, accepted_tokens: int = 0,
                            logprobs=None, prompt_logprobs=None) -> None:
        await self.report_load()
        await self.publish_tokens(
            request_id, index, token_ids, logprobs=logprobs, prompt_logprobs=prompt_logprobs, finished=True,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, cached_tokens=cached_tokens,
                        draft_tokens=draft_tokens, accepted_tokens=accepted_tokens),
            timing=timing)

    async def shutdown(self) -> None:
        self.stop.set()
        if self.async_engine.cores is not None:  # its cores are the others' from now on
            self.async_engine.cores.close()
        if self.cache_events is not None:
            await self.cache_events.withdraw()
        for task in self._tasks:
            try:
                await asyncio.wait_for(task, 10)
            except Exception as exc:
                log.warning("task %s ended with %r", task.get_name(), exc)
        if self.nc is not None:
            # Flush what was published, then close. Not drain(): it waits for every subscription's
            # queue to empty, and the tasks that read them have ended (what they held is handed
            # back: JetStream redelivers unacked jobs), so it could only time out — and a timed-out
            # drain left a cancelled gather that asyncio logged as a traceback at every shutdown.
            try:  # NATS may be gone already (stopped first, or restarting): don't wait for it forever
                await asyncio.wait_for(self.nc.flush(), 3.0)
            except Exception as exc:
                log.warning("NATS flush failed (%r); closing", exc)
            await self.nc.close()
        if self.redis is not None:
            await self.redis.aclose()


async def attach_kvstore(nc, config: WorkerConfig, engine: LLMEngine) -> KVStoreClient:
    """Attach to this host's kvstore, waiting for it to come up, and check the block layout."""
    client = KVStoreClient(nc, config.kvstore, use_shm=config.kv_use_shm)
    while True:
        try:
            info = await client.attach()
            break
        except KVStoreError as exc:
            log.info("waiting for kvstore %s: %s", config.kvstore, exc)
            await asyncio.sleep(0.5)
    expected = engine.kv_cache.block_bytes
    if info.block_bytes != expected:
        raise SystemExit(f"kvstore {config.kvstore} keeps {info.block_bytes}-byte blocks ({info.layout}), "
                         f"this worker's KV blocks are {expected} bytes: start both with the same model and dtype")
    return client


async def keep_in_progress(msg, ack_wait: float) -> None:
    """Tell JetStream the job is alive while a long prefill runs (else it would be redelivered)."""
    while True:
        await asyncio.sleep(ack_wait / 3)
        await safe(msg.in_progress())


async def wait_any(*events: asyncio.Event) -> None:
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for w in waiters:
        w.cancel()


async def safe(coro) -> None:
    try:
        await coro
    except Exception as exc:
        log.warning("NATS ack/nak failed: %s", exc)


async def run_worker(worker: WorkerRuntime, grace_s: float = 10.0) -> None:
    """Run until SIGTERM/SIGINT, then drain: stop taking jobs, let running requests finish (up to
    `grace_s`), close connections."""
    import signal

    from shared.telemetry import tracing

    cfg = worker.config
    tracing.setup(cfg.role, cfg.instance, cfg.otlp_endpoint, cfg.trace_sample_ratio)
    loop = asyncio.get_running_loop()
    draining = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, draining.set)
    job_loop = asyncio.create_task(worker.run())
    done, _ = await asyncio.wait({job_loop, asyncio.ensure_future(draining.wait())},
                                 return_when=asyncio.FIRST_COMPLETED)
    if job_loop in done:
        job_loop.result()  # a fatal error: raise it
    job_loop.cancel()
    worker.draining = True
    log.info("draining: %d requests in flight", len(worker.attempts))
    try:  # at once: a job routed here from now on would wait for the gateway to give up on it
        await asyncio.wait_for(worker.report_load(), 2.0)
    except Exception as exc:
        log.warning("could not announce draining: %r", exc)
    deadline = loop.time() + grace_s
    # a request is done when its last event is published (decode) or its job acked (prefill);
    # what is still held at the deadline is handed back: the gateway migrates it, JetStream redelivers
    while (worker.attempts or worker.async_engine.num_requests) and loop.time() < deadline:
        await asyncio.sleep(0.05)
    if worker.attempts:
        log.warning("grace period over: handing back %d requests", len(worker.attempts))
    await worker.shutdown()
    tracing.shutdown()
