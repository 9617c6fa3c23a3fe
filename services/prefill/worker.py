"""The prefill worker: pull a PrefillJob → reuse cached prefix blocks → prefill the rest → publish
token 1 → write the new blocks to the kvstore → publish a DecodeJob (and tell the gateway that the
request is queued for decode) → ack.

Jobs are pulled only while fewer than `max_inflight` are in progress (backpressure: the rest wait in
the JetStream queue). A job is acked only once its DecodeJob is published, so a worker that dies
mid-job has it redelivered (bounded by max_deliver); the gateway drops the duplicate first token by
its index.
"""

from __future__ import annotations

import asyncio
import logging
import time

import torch

from shared.config import WorkerConfig
from shared.engine.engine import LLMEngine
from shared.engine.sequence import FinishReason
from shared.kvcache.block_hash import block_keys
from shared.protocol import subjects
from shared.protocol.messages import DecodeJob, ErrorCode, KVBlockRef, PrefillJob, Timing, encode
from shared.telemetry import tracing
from shared.transport import nats_bus
from shared.transport.kv_client import KVStoreClient, KVStoreError
from shared.transport.worker import WorkerRuntime, attach_kvstore, keep_in_progress, wait_any

log = logging.getLogger(__name__)


class PrefillWorker(WorkerRuntime):
    def __init__(self, config: WorkerConfig, engine: LLMEngine):
        super().__init__(config, engine)
        self.kv: KVStoreClient | None = None
        self.inflight = 0
        self._room = asyncio.Event()

    async def run(self) -> None:
        await self.start()
        c = self.config
        self.kv = await attach_kvstore(self.nc, c, self.engine)
        shared = await nats_bus.pull_subscription(self.js, subjects.PREFILL_STREAM, "prefill", subjects.PREFILL_JOBS,
                                                  ack_wait=c.ack_wait_s, max_deliver=c.max_deliver)
        own = await nats_bus.worker_subscription(self.js, subjects.PREFILL_STREAM, subjects.PREFILL_JOBS, c.instance,
                                                 ack_wait=c.ack_wait_s, max_deliver=c.max_deliver)
        self.ready()
        await asyncio.gather(self._pull(own), self._pull(shared))

    async def _pull(self, sub) -> None:
        """Take jobs from `sub` while fewer than max_inflight run (both consumers share the count;
        together they may overshoot it by one fetch)."""
        while not self.stop.is_set():
            room = self.config.max_inflight - self.inflight
            if room <= 0:
                self._room.clear()
                await wait_any(self._room, self.stop)
                continue
            try:
                msgs = await sub.fetch(room, timeout=0.5)
            except (asyncio.TimeoutError, TimeoutError):
                continue
            except Exception as exc:  # NATS down: the client reconnects; try again shortly
                log.warning("fetch failed: %s", exc)
                await asyncio.sleep(0.5)
                continue
            for msg in msgs:
                self.inflight += 1
                asyncio.create_task(self._handle(msg))

    async def _handle(self, msg) -> None:
        try:
            await self._prefill(msg)
        except Exception:
            await self.job_failed(msg, PrefillJob)
        finally:
            self.inflight -= 1
            self._room.set()

    async def _prefill(self, msg) -> None:
        job = await self.accept(msg, PrefillJob)
        if job is None:
            return
        taken = time.time()
        rid = job.request_id
        index = len(job.resume_ids)
        span = tracing.tracer.start_span(
            "prefill", context=tracing.context_from(msg.headers), kind=tracing.SpanKind.CONSUMER,
            start_time=int((job.created_at or taken) * 1e9),
            attributes={"pdserve.request_id": rid, "pdserve.worker": self.config.instance,
                        "pdserve.attempt": job.attempt, "gen_ai.usage.input_tokens": len(job.prompt_ids)})
        if job.created_at:
            tracing.span_at("prefill.queue", span, job.created_at, taken)
        keep_alive = asyncio.create_task(keep_in_progress(msg, self.config.ack_wait_s))
        try:
            params = await self.params_or_reject(msg, rid, job.params, index, index)
            if params is None:
                return
            await self.publish_tokens(rid, index, [])  # "taken": the gateway's wait is no longer a queue wait
            await self._run_job(job, params, index, taken, span)
            keep_alive.cancel()
            await msg.ack()
        finally:
            keep_alive.cancel()
            span.end()
            self.done(rid, job.attempt)  # after the ack: a draining worker waits for this

    async def _run_job(self, job: PrefillJob, params, index: int, taken: float, span: tracing.Span) -> None:
        rid, tokens = job.request_id, job.prompt_ids + job.resume_ids
        bs = self.engine.config.block_size
        # every full block's key (none with prefix caching off: nothing is looked up or indexed)
        keys = block_keys(tokens, bs, self.engine.kv.model_id) if self.engine.config.enable_prefix_caching else []
        # leave ≥ 1 token to compute; the prompt's log-probabilities need every token computed
        lookup_keys = keys[: (len(tokens) - 1) // bs] if params.prompt_logprobs is None else []
        lease, hits, prefix, segment = "", [], None, ""
        t_read = time.time()
        try:
            found = await self.kv.lookup(lookup_keys, lease_ttl_s=self.config.lease_ttl_s)
            lease, hits, segment = found.lease_id, found.blocks, found.segment
            if hits:
                prefix = self.engine.kv_cache.empty_blocks(len(hits))
                await self.kv.read_blocks(lease, hits, prefix, segment=segment)
            t_read = time.time() - t_read
        except KVStoreError as exc:  # a prefix we cannot read is recomputed, never trusted
            log.warning("request %s: prefix cache unavailable (%s); computing the whole prompt", rid, exc)
            await self._release(lease)
            lease, hits, prefix, segment, t_read = "", [], None, "", 0.0
        self.prefix_queries += len(lookup_keys)
        self.prefix_hits += len(hits)
        t0 = time.time()
        tracing.span_at("kv.lookup", span, taken, t0, **{"pdserve.cached_tokens": len(hits) * bs})
        stream = self.async_engine.add_request(rid, tokens, params, prefill_only=True, prefix_kv=prefix,
                                               num_resumed=index)
        renew = (lambda: self.kv.renew(lease, self.config.lease_ttl_s)) if lease else None
        item = await self.first_output(stream, index, renew)
        prefill_s = time.time() - t0
        if item.error is not None:
            await self._release(lease)
            await self.publish_error(rid, index, ErrorCode.BAD_REQUEST, str(item.error))
            return
        out = item.output
        tracing.span_at("prefill.compute", span, t0, t0 + prefill_s,
                        **{"pdserve.prefill_seconds": out.prefill_compute_s,
                           "pdserve.prefill_core_seconds": out.prefill_core_s})
        if out.finish_reason == FinishReason.ABORT:
            await self._release(lease)
            return
        timing = Timing(queue_s=max(0.0, taken - job.created_at) if job.created_at else 0.0, prefill_s=prefill_s,
                        prefill_compute_s=out.prefill_compute_s, decode_compute_s=out.decode_compute_s,
                        prefill_core_s=out.prefill_core_s, decode_core_s=out.decode_core_s,
                        kv_read_s=t_read if hits else 0.0, kv_bytes_read=prefix.nbytes if hits else 0)
        if out.finish_reason != FinishReason.PREFILLED:  # the first token already ends the request
            await self._release(lease)
            await self.publish_final(rid, index, out.new_token_ids, finish_reason=str(out.finish_reason),
                                     stop_reason=out.stop_reason, prompt_tokens=len(job.prompt_ids),
                                     completion_tokens=index + 1, cached_tokens=len(hits) * bs, timing=timing,
                                     logprobs=out.logprobs, prompt_logprobs=out.prompt_logprobs)
            return
        await self.report_load()
        await self.publish_tokens(rid, index, out.new_token_ids, logprobs=out.logprobs,  # token 1: this is TTFT
                                  prompt_logprobs=out.prompt_logprobs)
        t_write = time.time()
        refs, lease, segment = await self._store_blocks(rid, item.kv_blocks, hits, keys, lease, segment, timing)
        tracing.span_at("kv.write", span, t_write, time.time(), **{"pdserve.kv_bytes": timing.kv_bytes_written})
        decode_job = DecodeJob(
            request_id=rid, token_ids=tokens, first_token=out.new_token_ids[0], params=job.params,
            store=self.config.kvstore if refs else "", lease_id=lease, blocks=refs, segment=segment,
            num_cached_tokens=len(hits) * bs, num_prompt_tokens=len(job.prompt_ids), num_resumed=index,
            created_at=time.time(), deadline=job.deadline, attempt=job.attempt, timing=timing,
        )
        span.set_attributes({"pdserve.cached_tokens": len(hits) * bs, "pdserve.kv_bytes": timing.kv_bytes_written})
        # a redelivered prefill job (this worker died before its ack) publishes the same id: stored once;
        # while the decode queue does not answer (its leader being elected), the gateway hears that
        # this worker still has the request
        await nats_bus.publish_job(self.js, subjects.DECODE_JOBS, encode(decode_job), f"{rid}.{job.attempt}.decode",
                                   headers=tracing.headers_for(span),
                                   on_retry=lambda: self.publish_tokens(rid, index + 1, []))
        # the request waits for a decode worker with room now, as long as the decode pool is busy
        await self.publish_tokens(rid, index + 1, [], queued=True)

    async def _store_blocks(self, rid: str, blocks: torch.Tensor, hits: list[KVBlockRef], keys: list[bytes],
                            lease: str, segment: str, timing: Timing) -> tuple[list[KVBlockRef], str, str]:
        """Write the blocks the store does not have yet; returns refs to all blocks, the lease and
        the segment they are in. If the store fails (or restarted since the lookup: the hits'
        segment is gone), the DecodeJob goes out without blocks and decode recomputes the prompt."""
        t0 = time.time()
        new = blocks[len(hits):]
        try:
            alloc = await self.kv.allocate(new.shape[0], lease_id=lease, lease_ttl_s=self.config.lease_ttl_s)
            lease = alloc.lease_id
            if hits and alloc.segment != segment:  # cannot happen with a lease the store still knows
                raise KVStoreError(ErrorCode.KV_TRANSFER_FAILED, "the prefix hits are in a segment the store "
                                                                 "no longer has")
            checksums = await self.kv.write_blocks(lease, alloc.slots, new, segment=alloc.segment)
            new_keys = [keys[i] if i < len(keys) else b"" for i in range(len(hits), blocks.shape[0])]
            await self.kv.commit(lease, alloc.slots, new_keys, checksums)
        except KVStoreError as exc:
            log.warning("request %s: could not store KV (%s); decode will recompute", rid, exc)
            await self._release(lease)
            return [], "", ""
        timing.kv_write_s = time.time() - t0
        timing.kv_bytes_written = new.nbytes
        return hits + [KVBlockRef(s, c) for s, c in zip(alloc.slots, checksums)], lease, alloc.segment

    async def _release(self, lease: str) -> None:
        if lease:
            try:
                await self.kv.release(lease)
            except KVStoreError as exc:
                log.warning("lease %s not released (%s); it will expire", lease, exc)
