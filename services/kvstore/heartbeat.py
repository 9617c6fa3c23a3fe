"""What the store tells the world every heartbeat.

    NATS    pd.stats.kvstore.<store>      WorkerStats (the gateway re-exports it on /metrics)
    Valkey  pd:worker:kvstore:<store>     the same WorkerStats, with a TTL (the registry)
            pd:kv:<key hex>               SADD/SREM <store> as blocks are indexed/evicted (routing hints)

Valkey holds hints only (routers confirm with the store), so a Valkey outage is logged and the
pending index events are retried next tick, never fatal. If the registry entry was gone when we
refreshed it (Valkey restarted or was flushed, or we were away longer than its TTL), the routing
hints are gone too: the whole index is written again.
"""

from __future__ import annotations

import asyncio
import logging
import time

import redis.asyncio as aioredis
from nats.aio.client import Client as NATS
from redis.exceptions import RedisError

from services.kvstore.config import KVStoreConfig
from services.kvstore.pool import SlotPool
from shared.kvcache.block_pool import BlockEvicted, BlockStored
from shared.protocol import subjects
from shared.protocol.messages import WorkerStats, encode

log = logging.getLogger(__name__)

MAX_PENDING_EVENTS = 1_000_000  # beyond this, drop them and rewrite the whole index once Valkey is back
RESYNC_BATCH = 10_000  # SADDs per pipeline round trip when rewriting the index


class Heartbeat:
    def __init__(self, config: KVStoreConfig, pool: SlotPool, nc: NATS, redis: aioredis.Redis):
        self.config, self.pool, self.nc, self.redis = config, pool, nc, redis
        self.store = config.store
        self._pending: list[BlockStored | BlockEvicted] = []  # taken from the pool, not yet in Valkey
        self._synced_once = False
        self._resync = False
        self._valkey_ok = True
        self._lock = asyncio.Lock()  # one Valkey sync at a time: SADD/SREM must land in event order

    @property
    def num_pending_hints(self) -> int:
        """Routing-hint updates taken from the pool but not yet written to Valkey."""
        return len(self._pending)

    def stats(self) -> WorkerStats:
        return WorkerStats(
            role="kvstore", instance=self.store, kv_blocks_total=self.pool.num_slots,
            kv_blocks_in_use=self.pool.num_in_use, kv_blocks_cached=self.pool.num_cached,
            prefix_queries=self.pool.prefix_queries, prefix_hits=self.pool.prefix_hits, ts=time.time(),
        )

    async def publish_stats(self) -> None:
        await self.nc.publish(subjects.stats("kvstore", self.store), encode(self.stats()))

    async def sync_valkey(self) -> None:
        """Refresh the registry entry and mirror the pool's index events; raises on Valkey errors
        (the events stay pending)."""
        async with self._lock:
            self._pending.extend(self.pool.take_events())
            if len(self._pending) > MAX_PENDING_EVENTS:
                log.warning("kvstore: %d routing-hint updates pending; dropping them, the index will be "
                            "rewritten", len(self._pending))
                self._pending.clear()
                self._resync = True
            sent, self._pending = self._pending, []
            pipe = self.redis.pipeline(transaction=False)
            # SET … GET returns the previous value: None means our entry (and so our hints) vanished
            pipe.set(subjects.registry_key("kvstore", self.store), encode(self.stats()),
                     px=round(self.config.registry_ttl_s * 1000), get=True)
            for event in sent:
                key = subjects.block_index_key(event.key)
                if isinstance(event, BlockStored):
                    pipe.sadd(key, self.store)
                else:
                    pipe.srem(key, self.store)
            try:
                previous, *_ = await pipe.execute()
            except BaseException:
                self._pending[:0] = sent  # retry them first next time, in order
                raise
            if (previous is None and self._synced_once) or self._resync:
                log.info("kvstore: rewriting the routing hints of %d indexed blocks", self.pool.num_cached)
                await self._rewrite_index()
                self._resync = False
            self._synced_once = True

    async def _rewrite_index(self) -> None:
        keys = self.pool.indexed_keys()
        for start in range(0, len(keys), RESYNC_BATCH):
            pipe = self.redis.pipeline(transaction=False)
            for key in keys[start:start + RESYNC_BATCH]:
                pipe.sadd(subjects.block_index_key(key), self.store)
            await pipe.execute()

    async def withdraw(self) -> None:
        """On shutdown: leave the registry and every routing hint (best effort)."""
        async with self._lock:
            self._pending.extend(self.pool.take_events())
            keys = set(self.pool.indexed_keys()) | {e.key for e in self._pending if isinstance(e, BlockStored)}
            pipe = self.redis.pipeline(transaction=False)
            pipe.delete(subjects.registry_key("kvstore", self.store))
            for key in keys:
                pipe.srem(subjects.block_index_key(key), self.store)
            await pipe.execute()
            self._pending.clear()

    async def run_nats(self) -> None:
        while True:
            try:
                await self.publish_stats()
            except Exception as exc:  # disconnected with a full buffer, draining: next tick
                log.warning("kvstore: cannot publish stats: %s", exc)
            await asyncio.sleep(self.config.heartbeat_s)

    async def run_valkey(self) -> None:
        while True:
            try:
                await self.sync_valkey()
                if not self._valkey_ok:
                    log.info("kvstore: Valkey is reachable again")
                self._valkey_ok = True
            except (RedisError, OSError) as exc:
                # log an outage once, then quietly retry every tick
                log.log(logging.WARNING if self._valkey_ok else logging.DEBUG,
                        "kvstore: Valkey sync failed (%s); %d routing-hint updates pending, retrying",
                        exc, len(self._pending))
                self._valkey_ok = False
            except Exception:
                log.exception("kvstore: Valkey sync failed unexpectedly; retrying next tick")
            await asyncio.sleep(self.config.heartbeat_s)
