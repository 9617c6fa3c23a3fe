"""The decode worker: pull a DecodeJob only when there is a free slot and room for its blocks (one
that does not fit beside the running requests goes back to the queue once, for a worker with room;
one that comes back waits here, its blocks in the store, until it fits or another worker has room)
→ copy the blocks from the kvstore (shared memory on this host) → release the lease → join the
running batch → publish every step's tokens → the final event with usage and timing.

The same worker also runs whole requests (role `colocated`: PrefillJobs from the prefill queue;
and, in conditional mode, short prompts the gateway sends straight to `pd.decode.direct`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

import msgspec

from shared.config import WorkerConfig, pull_reserve
from shared.engine.async_engine import RequestStream
from shared.engine.engine import LLMEngine
from shared.engine.sequence import FinishReason
from shared.protocol import subjects
from shared.protocol.convert import to_params
from shared.protocol.messages import DecodeJob, ErrorCode, PrefillJob, Timing, WorkerStats, decode, encode
from shared.telemetry import tracing
from shared.transport import nats_bus
from shared.transport.kv_client import KVStoreClient, KVStoreError
from shared.transport.worker import WorkerRuntime, attach_kvstore, keep_in_progress, safe

log = logging.getLogger(__name__)

HAND_BACK_PAUSE_S = 0.2  # after handing a job back, a worker lets the others pull first
PEER_STATS_FRESH_S = 1.0  # another decode worker's stats (every 0.25 s) count this long


class DecodeWorker(WorkerRuntime):
    def __init__(self, config: WorkerConfig, engine: LLMEngine):
        super().__init__(config, engine)
        self.kv: KVStoreClient | None = None
        self._stores: dict[str, KVStoreClient] = {}  # other hosts' kvstores (network path)
        self._waiting_for_blocks = False  # a taken job waits for room in the engine's KV cache
        self._handed_back_at = -math.inf  # when this worker last put a job it had no room for back
        self._peers: dict[str, tuple[float, WorkerStats]] = {}  # while a job waits: the other decode workers' stats

    async def run(self) -> None:
        await self.start()
        c = self.config
        consumers = []
        if c.role == "colocated":
            sub = await nats_bus.pull_subscription(self.js, subjects.PREFILL_STREAM, "prefill", subjects.PREFILL_JOBS,
                                                   ack_wait=c.ack_wait_s, max_deliver=c.max_deliver)
            own = await nats_bus.worker_subscription(self.js, subjects.PREFILL_STREAM, subjects.PREFILL_JOBS,
                                                     c.instance, ack_wait=c.ack_wait_s, max_deliver=c.max_deliver)
            consumers += [(own, self._take_whole), (sub, self._take_whole)]
        else:
            self.kv = await attach_kvstore(self.nc, c, self.engine)
            jobs = await nats_bus.pull_subscription(self.js, subjects.DECODE_STREAM, "decode", subjects.DECODE_JOBS,
                                                    ack_wait=c.ack_wait_s, max_deliver=c.max_deliver)
            direct = await nats_bus.pull_subscription(self.js, subjects.DECODE_STREAM, "decode-direct",
                                                      subjects.DECODE_DIRECT, ack_wait=c.ack_wait_s,
                                                      max_deliver=c.max_deliver)
            own = await nats_bus.worker_subscription(self.js, subjects.DECODE_STREAM, subjects.DECODE_DIRECT,
                                                     c.instance, ack_wait=c.ack_wait_s, max_deliver=c.max_deliver)
            consumers += [(jobs, self._take_decode), (direct, self._take_whole), (own, self._take_whole)]
        self.ready()
        await asyncio.gather(*(self._pull(sub, take) for sub, take in consumers))

    def _has_room(self) -> bool:
        """A free slot, and free blocks beyond a reserve for the running sequences to grow (a job's own
        size is known only once it is pulled: `_hand_back`)."""
        e = self.engine
        if self._waiting_for_blocks or time.monotonic() - self._handed_back_at < HAND_BACK_PAUSE_S:
            return False
        return self.async_engine.num_requests < e.config.max_num_seqs and \
            e.pool.num_free_blocks > pull_reserve(e.config.num_kv_blocks)

    async def _pull(self, sub, take) -> None:
        while not self.stop.is_set():
            if not self._has_room():
                await asyncio.sleep(0.02)
                continue
            try:
                # one job a pull: each takes its blocks before the next one's room check, and a pull of
                # several stays open at the server after its first job and catches the next one
                # published (a job this worker had just handed back came straight back to it)
                msgs = await sub.fetch(1, timeout=0.5)
            except (asyncio.TimeoutError, TimeoutError):
                continue
            except Exception as exc:
                log.warning("fetch failed: %s", exc)
                await asyncio.sleep(0.5)
                continue
            for msg in msgs:
                # kept in progress until taken: it may wait long for room (_wait_for_blocks), and a job
                # JetStream redelivered elsewhere after its ack wait would then run twice
                keep_alive = asyncio.create_task(keep_in_progress(msg, self.config.ack_wait_s))
                try:
                    await take(msg)
                except Exception:
                    await self.job_failed(msg, DecodeJob if take == self._take_decode else PrefillJob)
                finally:
                    keep_alive.cancel()

    # ------------------------------------------------------------------------------- DecodeJob

    async def _take_decode(self, msg) -> None:
        job = await self.accept(msg, DecodeJob, on_skip=self._release)
        if job is None:
            return
        try:
            await self._decode(msg, job)
        except asyncio.CancelledError:
            # stopped (a drain) before the job joined the engine, e.g. while it waited for room: it goes
            # back to the queue now, for another worker, not after its ack wait; the drain does not wait for it
            if not msg.is_acked:
                self.done(job.request_id, job.attempt)
                log.info("request %s: this worker stops; back to the decode queue", job.request_id)
                await safe(msg.nak())
            raise

    async def _decode(self, msg, job: DecodeJob) -> None:
        if await self._hand_back(msg, job) or not await self._wait_unread(msg, job):
            return
        taken = time.time()
        rid = job.request_id
        log.info("took request %s (%d tokens, %d blocks)", rid, len(job.token_ids), len(job.blocks))
        await self.publish_tokens(rid, job.num_resumed + 1, [])  # "taken": the gateway now watches this worker
        index = job.num_resumed + 1  # the first token was published by the prefill worker
        params = await self.params_or_reject(msg, rid, job.params, job.num_resumed, index)
        if params is None:
            self.done(rid, job.attempt)
            await self._release(job)
            return
        span = self._job_span("decode", msg, rid, job.attempt, job.created_at, taken)
        timing = job.timing
        timing.decode_queue_s = max(0.0, taken - job.created_at) if job.created_at else 0.0
        t_read = time.time()
        blocks = await self._read_blocks(job, timing)
        if job.blocks:
            tracing.span_at("kv.read", span, t_read, time.time(), **{"pdserve.kv_bytes": timing.kv_bytes_read})
        if blocks is not None and not await self._wait_for_blocks(job, index):
            self.done(rid, job.attempt)  # cancelled while it waited
            tracing.end_error(span, "cancelled while waiting for KV cache room")
            await msg.ack()
            return
        if blocks is None and self.config.kv_failure_policy == "fail":
            await self.publish_error(rid, index, ErrorCode.KV_TRANSFER_FAILED,
                                     f"KV blocks of request {rid} could not be read from kvstore {job.store}")
            tracing.end_error(span, "KV blocks could not be read")
            self.done(rid, job.attempt)
            await msg.ack()
            return
        if blocks is None:  # recompute: prefill prompt + first token here, continue after it
            stream = self.async_engine.add_request(rid, job.token_ids + [job.first_token],
                                                   to_params(job.params, num_resumed=index), num_resumed=index)
        else:
            stream = self.async_engine.add_prefilled(rid, job.token_ids, job.first_token, blocks, params,
                                                     num_resumed=job.num_resumed,
                                                     num_cached_tokens=job.num_cached_tokens)
        await msg.ack()
        asyncio.create_task(self._stream(stream, job.attempt, job.num_prompt_tokens, job.num_cached_tokens, timing,
                                         span))

    def _blocks_needed(self, job: DecodeJob) -> int:
        return -(-(len(job.token_ids) + 1) // self.engine.config.block_size)  # the prompt and its first token

    def _no_room_for(self, need: int) -> bool:
        return bool(self.async_engine.num_requests) and self.engine.pool.num_free_blocks < need

    async def _hand_back(self, msg, job: DecodeJob) -> bool:
        """A job whose blocks do not fit while this worker's requests hold its KV cache goes back to
        the decode queue, once per worker, for one with room to take (the pull cannot see a job's
        size before taking it). The blocks stay in the store, unread; the gateway still sees the
        request queued. A job that comes back to a worker that handed it back waits there
        (`_wait_unread`). True if it was handed back."""
        need = self._blocks_needed(job)
        if not self._no_room_for(need) or self.config.instance in job.handed_back:
            return False
        return await self._republish(msg, job, f"needs {need} KV blocks ({self.engine.pool.num_free_blocks} free)")

    async def _republish(self, msg, job: DecodeJob, why: str) -> bool:
        """Put the job back at the end of the decode queue, this worker named in its `handed_back`,
        and take nothing for HAND_BACK_PAUSE_S, so a worker already waiting to pull gets it first.
        False if the queue does not answer (the job stays here)."""
        me = self.config.instance
        again = msgspec.structs.replace(job, handed_back=[*job.handed_back, me])
        headers = {k: v for k, v in (msg.headers or {}).items() if k != "Nats-Msg-Id"}  # its trace
        try:
            await nats_bus.publish_job(self.js, subjects.DECODE_JOBS, encode(again),
                                       f"{job.request_id}.{job.attempt}.decode.{len(again.handed_back)}",
                                       headers=headers, retry_s=2.0)
        except Exception as exc:  # the queue does not answer: wait for room here instead
            log.warning("request %s could not be handed back (%s); it waits here", job.request_id, exc)
            return False
        self._handed_back_at = time.monotonic()
        self.done(job.request_id, job.attempt)
        await msg.ack()
        log.info("request %s %s: handed back to the decode queue", job.request_id, why)
        return True

    async def _wait_unread(self, msg, job: DecodeJob) -> bool:
        """A job that came back to this worker with no room for it here waits, before its blocks are
        read: they stay in the store, its lease renewed, while the running requests free room. If
        another decode worker's stats show room for it first, it is handed back once more for that
        one (at most twice per worker). Meanwhile this worker takes no other job and JetStream hears
        the job is alive (`_pull` keeps it in progress: were this worker to die, the job would be
        redelivered after its ack wait; stopped, it puts the job back at once); the gateway sees it
        queued, as it is. True: take it here now; False: it was handed on, or cancelled meanwhile
        (its lease released)."""
        need, me = self._blocks_needed(job), self.config.instance
        if not self._no_room_for(need):
            return True
        log.info("request %s waits for %d KV blocks (%d free), its blocks in the store", job.request_id, need,
                 self.engine.pool.num_free_blocks)
        ttl = self.config.lease_ttl_s
        renewed = time.monotonic()
        self._waiting_for_blocks = True
        self._peers, peers = {}, None
        try:
            peers = await self.nc.subscribe(subjects.stats("decode", "*"), cb=self._on_peer_stats)  # while it waits
            while self._no_room_for(need):
                if self.cancelled.covers(job.request_id, job.attempt):
                    self.done(job.request_id, job.attempt)
                    await self._release(job)
                    await msg.ack()
                    return False
                peer = self._peer_with_room(need) if job.handed_back.count(me) < 2 else None
                if peer and await self._republish(msg, job, f"waited for {need} KV blocks; {peer} has room"):
                    return False
                if job.lease_id and time.monotonic() - renewed > ttl / 3:
                    renewed = time.monotonic()
                    try:
                        await (await self._store(job.store)).renew(job.lease_id, ttl)
                    except Exception as exc:  # gone, or the store away: the read will tell (and the policy apply)
                        log.warning("request %s: lease %s not renewed (%s)", job.request_id, job.lease_id, exc)
                await asyncio.sleep(0.02)
            return True
        finally:
            self._waiting_for_blocks = False
            if peers is not None:
                try:
                    await peers.unsubscribe()
                except Exception as exc:  # NATS away: the subscription goes with the connection
                    log.warning("stats subscription not ended: %s", exc)

    async def _on_peer_stats(self, msg) -> None:
        try:
            s = decode(msg.data, WorkerStats)
        except Exception as exc:
            log.warning("malformed stats on %s skipped: %s", msg.subject, exc)
            return
        if s.instance != self.config.instance:
            self._peers[s.instance] = (time.monotonic(), s)

    def _peer_with_room(self, need: int) -> str | None:
        """Another decode worker whose last stats (fresh) show that it would pull now and fit `need`
        blocks: a free slot, and free blocks beyond its reserve and at least `need`."""
        now = time.monotonic()
        for name, (at, s) in self._peers.items():
            if now - at > PEER_STATS_FRESH_S:
                continue
            free = s.kv_blocks_total - s.kv_blocks_in_use
            if not s.draining and s.free_slots > 0 and free >= need and free > pull_reserve(s.kv_blocks_total):
                return name
        return None

    async def _wait_for_blocks(self, job: DecodeJob, index: int) -> bool:
        """Wait until the engine's KV cache has room for the job's prompt and first token while the
        requests it runs free theirs (a job taken while a long one filled the cache failed with "no
        room for N KV blocks"). Meanwhile this worker takes no other job, JetStream hears the job is
        alive (`_pull` keeps it in progress), and the gateway that the request is queued here. False if
        it was cancelled meanwhile."""
        need = self._blocks_needed(job)
        running, pool = self.async_engine, self.engine.pool
        try:
            while running.num_requests and (running.num_adding or pool.num_free_blocks < need):
                if self.cancelled.covers(job.request_id, job.attempt):
                    return False
                if not self._waiting_for_blocks:
                    log.info("request %s waits for %d KV blocks (%d free)", job.request_id, need, pool.num_free_blocks)
                    self._waiting_for_blocks = True
                    await self.publish_tokens(job.request_id, index, [], queued=True)
                await asyncio.sleep(0.02)
            return True
        finally:
            self._waiting_for_blocks = False

    def _job_span(self, name: str, msg, rid: str, attempt: int, created_at: float, taken: float) -> tracing.Span:
        """This worker's span of a job, in the trace the job's headers carry, from its publication
        (the queue wait is its first child)."""
        span = tracing.tracer.start_span(
            name, context=tracing.context_from(msg.headers), kind=tracing.SpanKind.CONSUMER,
            start_time=int((created_at or taken) * 1e9),
            attributes={"pdserve.request_id": rid, "pdserve.worker": self.config.instance, "pdserve.attempt": attempt})
        if created_at:
            tracing.span_at(f"{name}.queue", span, created_at, taken)
        return span

    async def _read_blocks(self, job: DecodeJob, timing: Timing):
        """The job's blocks as a tensor, or None when they cannot be had (missing, corrupt, store
        down): the caller applies the failure policy. The lease is released either way."""
        if not job.blocks:
            return None
        t0 = time.time()
        try:
            store = await self._store(job.store)
            out = self.engine.kv_cache.empty_blocks(len(job.blocks))
            await store.read_blocks(job.lease_id, job.blocks, out, segment=job.segment)
            timing.kv_read_s += time.time() - t0
            timing.kv_bytes_read += out.nbytes
            return out
        except KVStoreError as exc:
            log.warning("request %s: KV transfer failed (%s)", job.request_id, exc)
            return None
        finally:
            await self._release(job)

    async def _store(self, name: str) -> KVStoreClient:
        """The client of kvstore `name`: this host's (shared memory), or another host's, attached on
        first use over the network path (the prefill worker that wrote the blocks was there)."""
        if not name or name == self.config.kvstore:
            return self.kv
        client = self._stores.get(name)
        if client is None:
            client = KVStoreClient(self.nc, name, use_shm=False)
            info = await client.attach()
            if info.block_bytes != self.engine.kv_cache.block_bytes:
                raise KVStoreError(ErrorCode.BAD_REQUEST, f"kvstore {name} keeps {info.block_bytes}-byte blocks, "
                                                          f"this worker's are {self.engine.kv_cache.block_bytes}")
            log.info("reading KV from kvstore %s (another host) over the network path", name)
            self._stores[name] = client
        return client

    async def _release(self, job: DecodeJob) -> None:
        if job.lease_id and self.kv is not None:
            try:
                await (await self._store(job.store)).release(job.lease_id)
            except KVStoreError as exc:
                log.warning("lease %s not released (%s); it will expire", job.lease_id, exc)

    # ------------------------------------------------------------------------- whole requests

    async def _take_whole(self, msg) -> None:
        job = await self.accept(msg, PrefillJob)
        if job is None:
            return
        taken = time.time()
        rid, index = job.request_id, len(job.resume_ids)
        params = await self.params_or_reject(msg, rid, job.params, index, index)
        if params is None:
            self.done(rid, job.attempt)
            return
        log.info("took request %s (%d tokens, whole)", rid, len(job.prompt_ids) + index)
        await self.publish_tokens(rid, index, [])  # "taken"
        span = self._job_span("generate", msg, rid, job.attempt, job.created_at, taken)
        stream = self.async_engine.add_request(rid, job.prompt_ids + job.resume_ids, params, num_resumed=index)
        await msg.ack()
        timing = Timing(queue_s=max(0.0, taken - job.created_at) if job.created_at else 0.0)
        asyncio.create_task(self._stream(stream, job.attempt, len(job.prompt_ids), 0, timing, span))

    # ------------------------------------------------------------------------------ streaming

    async def _stream(self, stream: RequestStream, attempt: int, prompt_tokens: int, cached_tokens: int,
                      timing: Timing, span: tracing.Span) -> None:
        """Publish a request's outputs as TokenEvents until it ends."""
        t0 = time.time()
        try:
            await self._publish_outputs(stream, prompt_tokens, cached_tokens, timing)
        finally:
            tracing.span_at("decode.compute", span, t0, time.time(),
                            **{"pdserve.decode_seconds": timing.decode_compute_s,
                               "pdserve.decode_core_seconds": timing.decode_core_s,
                               "pdserve.prefill_seconds_here": timing.prefill_compute_s})
            span.end()
            self.done(stream.request_id, attempt)

    async def _publish_outputs(self, stream: RequestStream, prompt_tokens: int, cached_tokens: int,
                               timing: Timing) -> None:
        rid = stream.request_id
        t0 = time.time()
        item = await self.first_output(stream, 0)  # a prompt computed here (whole, or its KV lost) takes a while
        while True:
            if item.error is not None:
                code = ErrorCode.OVERLOADED if isinstance(item.error, MemoryError) else ErrorCode.BAD_REQUEST
                await self.publish_error(rid, 0, code, str(item.error))
                return
            out = item.output
            index = out.output_index
            if not out.finished:
                await self.publish_tokens(rid, index, out.new_token_ids, logprobs=out.logprobs,
                                          prompt_logprobs=out.prompt_logprobs)
                item = await stream.get()
                continue
            if out.finish_reason == FinishReason.ABORT:
                return
            timing.decode_s = time.time() - t0
            timing.prefill_compute_s += out.prefill_compute_s  # a prompt prefilled here (whole or recomputed)
            timing.decode_compute_s += out.decode_compute_s
            timing.prefill_core_s += out.prefill_core_s
            timing.decode_core_s += out.decode_core_s
            await self.publish_final(rid, index, out.new_token_ids, finish_reason=str(out.finish_reason),
                                     stop_reason=out.stop_reason, prompt_tokens=prompt_tokens,
                                     completion_tokens=index + len(out.new_token_ids),
                                     cached_tokens=max(cached_tokens, out.num_cached_tokens), timing=timing,
                                     draft_tokens=out.draft_tokens, accepted_tokens=out.accepted_tokens,
                                     logprobs=out.logprobs, prompt_logprobs=out.prompt_logprobs)
            return
