"""Tell every gateway's routing index what one place caches: a worker's engine, or a host's kvstore.

    pd.cache.events.<loc>   CacheEvents every `interval_s` when something changed (seq + 1), and a
                            keepalive (same seq, nothing in it) every `keepalive_s` otherwise
    pd.cache.sync.<loc>     request → CacheSnapshot: every key as of the last seq published
    pd:cache:<loc>          the same snapshot in Valkey, rewritten every `snapshot_s` when it changed
                            (TTL `snapshot_ttl_s`): a starting gateway reads these, then follows events

A snapshot is the publisher's own copy of the keys, kept from the batches it sends (read from the
pool once, at start): exactly the state as of its seq, and made without waiting for the pool's owner.
An engine's pool can be read only between steps, and a step can take seconds on a slow host: a
snapshot read from it held up the keepalives until the gateways forgot the location, and their
request for its snapshot timed out.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable

from shared.kvcache.block_pool import BlockEvicted, BlockStored
from shared.protocol import subjects
from shared.protocol.messages import CacheEvents, CacheSnapshot, encode

log = logging.getLogger(__name__)

TakeEvents = Callable[[], list[BlockStored | BlockEvicted]]
ReadKeys = Callable[[], Awaitable[list[bytes]]]  # the pool's keys now (once, at start)


def net_changes(events: list[BlockStored | BlockEvicted]) -> tuple[list[bytes], list[bytes]]:
    """(stored, evicted) after applying `events` in order: each key's last event wins."""
    last: dict[bytes, bool] = {}
    for event in events:
        last[event.key] = isinstance(event, BlockStored)
    return [k for k, s in last.items() if s], [k for k, s in last.items() if not s]


class CachePublisher:
    def __init__(self, nc, redis, location: str, take_events: TakeEvents, read_keys: ReadKeys, *,
                 interval_s: float = 0.1, keepalive_s: float = 1.0, snapshot_s: float = 5.0,
                 snapshot_ttl_s: float = 30.0) -> None:
        self.nc, self.redis, self.location = nc, redis, location
        self._take, self._read_keys = take_events, read_keys
        self.interval_s, self.keepalive_s = interval_s, keepalive_s
        self.snapshot_s, self.snapshot_ttl_s = snapshot_s, snapshot_ttl_s
        self.epoch = secrets.token_hex(6)  # this process's lifetime: a restart starts a new sequence
        self.seq = 0
        self._sub = None
        self._snapshot_seq = -1  # seq of the snapshot last written to Valkey
        self.keys: set[bytes] = set()  # as of `seq`

    async def start(self) -> None:
        self.keys = set(await self._read_keys())  # the batches to come re-apply what it already shows: harmless
        self._sub = await self.nc.subscribe(subjects.cache_sync(self.location), cb=self._on_sync)

    async def run(self, stop: asyncio.Event) -> None:
        last_sent = last_snapshot = 0.0
        while not stop.is_set():
            now = time.monotonic()
            try:
                if await self.publish_changes():
                    last_sent = now
                elif now - last_sent >= self.keepalive_s:
                    await self._send(CacheEvents(location=self.location, epoch=self.epoch, seq=self.seq))
                    last_sent = now
                if self.redis is not None and now - last_snapshot >= self.snapshot_s:
                    await self.write_snapshot()
                    last_snapshot = now
            except Exception as exc:  # NATS or Valkey away: the index catches up from the next batch
                log.warning("%s: routing-index update failed: %r", self.location, exc)
            try:
                await asyncio.wait_for(stop.wait(), self.interval_s)
            except TimeoutError:
                pass

    async def publish_changes(self) -> bool:
        """Publish what changed since the last call as the next batch; False when nothing did."""
        stored, evicted = net_changes(self._take())
        if not stored and not evicted:
            return False
        self.seq += 1
        self.keys.difference_update(evicted)
        self.keys.update(stored)
        await self._send(CacheEvents(location=self.location, epoch=self.epoch, seq=self.seq, stored=stored,
                                     evicted=evicted))
        return True

    def snapshot(self) -> CacheSnapshot:
        return CacheSnapshot(location=self.location, epoch=self.epoch, seq=self.seq, keys=list(self.keys))

    async def write_snapshot(self) -> None:
        key = subjects.cache_snapshot_key(self.location)
        if self.seq == self._snapshot_seq:  # nothing new: keep the one there alive
            if await self.redis.pexpire(key, round(self.snapshot_ttl_s * 1000)):
                return
        snap = self.snapshot()
        await self.redis.set(key, encode(snap), px=round(self.snapshot_ttl_s * 1000))
        self._snapshot_seq = snap.seq

    async def withdraw(self) -> None:
        """On a clean exit: tell the gateways to forget this location, and drop its snapshot."""
        try:
            await self._send(CacheEvents(location=self.location, epoch=self.epoch, seq=self.seq + 1, gone=True))
            if self._sub is not None:
                await self._sub.unsubscribe()
            if self.redis is not None:
                await self.redis.delete(subjects.cache_snapshot_key(self.location))
        except Exception as exc:
            log.warning("%s: could not withdraw from the routing index: %r", self.location, exc)

    async def _send(self, events: CacheEvents) -> None:
        await self.nc.publish(subjects.cache_events(self.location), encode(events))

    async def _on_sync(self, msg) -> None:
        if not msg.reply:
            return
        try:
            await self.publish_changes()  # so the reply's seq covers everything up to now
            await self.nc.publish(msg.reply, encode(self.snapshot()))
        except Exception as exc:
            log.warning("%s: routing-index sync failed: %r", self.location, exc)
