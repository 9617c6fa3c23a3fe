"""The routing index: which place holds which KV blocks, for every place that caches prefixes.

A place ("location") is a worker's engine cache (`worker.<instance>`) or a host's kvstore
(`store.<store>`). Each publishes CacheEvents (shared/transport/cache_events.py); every gateway keeps
its own copy of the index from them, so gateways agree without talking to each other:

    start    subscribe to pd.cache.events.> (buffering) → read the snapshots in Valkey (pd:cache:*)
             → replay the buffer on top
    follow   batch seq = last + 1: apply · same seq: a keepalive · a gap (a batch, or a keepalive,
             ahead of the last seq + 1) or a new epoch mid-way: ask the location for its snapshot
             (pd.cache.sync.<loc>), buffer until it answers; no answer: keep the keys, follow on
             from the newest batch, and ask again after 1, 2, 4 … 30 s (stale keys are misses)
    forget   a location that says it is gone, or is not heard from for `forget_after_s`

`match(keys)` answers, for a prompt's block keys (the shared `block_hash` contract), how many
leading blocks each location holds. It is a hint: a stale entry makes the router pick a place
that then misses and computes the prompt, never an error.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import msgspec
from redis.exceptions import RedisError

from shared.protocol import subjects
from shared.protocol.messages import CacheEvents, CacheSnapshot, decode

log = logging.getLogger(__name__)


@dataclass
class _Location:
    epoch: str = ""
    seq: int = 0
    keys: set[bytes] = field(default_factory=set)
    heard: float = 0.0  # time.monotonic() of its last message
    buffered: list[CacheEvents] | None = None  # events held while a snapshot is on its way
    retry_at: float | None = None  # a snapshot asked for did not come: ask again from then on
    retry_s: float = 0.0  # … after waiting this long (doubling)


class PrefixIndex:
    def __init__(self, *, forget_after_s: float = 10.0, sync_timeout_s: float = 2.0, sync_retry_s: float = 1.0,
                 sync_retry_max_s: float = 30.0) -> None:
        self.forget_after_s, self.sync_timeout_s = forget_after_s, sync_timeout_s
        self.sync_retry_s, self.sync_retry_max_s = sync_retry_s, sync_retry_max_s
        self.blocks: dict[bytes, set[str]] = {}  # key → locations holding it
        self.locations: dict[str, _Location] = {}
        self.resyncs = 0  # snapshots asked for after a gap (a metric of how lossy the event stream is)
        self._nc = None
        self._sub = None
        self._starting: list[CacheEvents] | None = None
        self._tasks: set[asyncio.Task] = set()

    # ----------------------------------------------------------------------------------- lifecycle

    async def start(self, nc, redis) -> None:
        self._nc = nc
        self._starting = []
        self._sub = await nc.subscribe(subjects.CACHE_EVENTS_ALL, cb=self._on_message)
        try:
            loaded = await self._load_snapshots(redis)
        except (RedisError, OSError, TimeoutError) as exc:  # Valkey away: the events and syncs rebuild it
            log.warning("routing index: no snapshots from Valkey (%r); rebuilding from the event stream", exc)
            loaded = 0
        buffered, self._starting = self._starting, None
        for events in buffered:
            self.apply(events)
        log.info("routing index: %d locations, %d blocks (%d snapshots from Valkey)", len(self.locations),
                 len(self.blocks), loaded)

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None
        for task in list(self._tasks):
            task.cancel()

    async def _load_snapshots(self, redis) -> int:
        names = [key async for key in redis.scan_iter(match=subjects.CACHE_SNAPSHOT_PATTERN, count=500)]
        loaded = 0
        for start in range(0, len(names), 100):
            for data in await redis.mget(names[start:start + 100]):
                if data is None:  # expired between the scan and the read
                    continue
                try:
                    self.load(decode(data, CacheSnapshot))
                    loaded += 1
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    log.warning("routing index: undecodable snapshot skipped: %s", exc)
        return loaded

    # ------------------------------------------------------------------------------------ updates

    async def _on_message(self, msg) -> None:
        try:
            events = decode(msg.data, CacheEvents)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("routing index: undecodable CacheEvents on %s dropped: %s", msg.subject, exc)
            return
        if self._starting is not None:
            self._starting.append(events)
        else:
            self.apply(events)

    def apply(self, ev: CacheEvents) -> None:
        if ev.gone:
            self.forget(ev.location)
            return
        loc = self.locations.get(ev.location)
        if loc is None or (ev.epoch != loc.epoch and ev.seq <= 1):
            # new, or restarted and this is its first batch (a restarted process starts empty)
            self.forget(ev.location)
            loc = self.locations[ev.location] = _Location(epoch=ev.epoch)
        loc.heard = time.monotonic()
        keepalive = not ev.stored and not ev.evicted  # a batch always holds a change
        if loc.buffered is not None:
            loc.buffered.append(ev)
        elif loc.retry_at is not None and loc.heard >= loc.retry_at:
            self._resync(ev.location, loc, ev)  # ask again for the snapshot that did not come
        elif ev.epoch == loc.epoch and ev.seq <= loc.seq:
            pass  # a keepalive, or a batch already applied
        elif ev.epoch == loc.epoch and ev.seq == loc.seq + 1 and not keepalive:
            self._change(ev.location, loc, ev.stored, ev.evicted)
            loc.seq = ev.seq
        else:  # batches were lost (a keepalive ahead of us says so too), or a new epoch met mid-way
            self._resync(ev.location, loc, ev)

    def load(self, snap: CacheSnapshot) -> None:
        """Replace a location's keys by its snapshot (batches after `snap.seq` apply on top)."""
        loc = self.locations.get(snap.location)
        if loc is None:
            loc = self.locations[snap.location] = _Location()
        self._change(snap.location, loc, [], list(loc.keys - set(snap.keys)))
        self._change(snap.location, loc, snap.keys, [])
        loc.epoch, loc.seq, loc.heard = snap.epoch, snap.seq, time.monotonic()

    def forget(self, location: str) -> None:
        loc = self.locations.pop(location, None)
        if loc is not None:
            self._change(location, loc, [], list(loc.keys))

    def prune(self) -> list[str]:
        """Forget the locations not heard from for `forget_after_s` (dead, or cut off); returns them."""
        now = time.monotonic()
        gone = [name for name, loc in self.locations.items() if now - loc.heard > self.forget_after_s]
        for name in gone:
            log.info("routing index: %s silent for %.0f s, forgotten", name, self.forget_after_s)
            self.forget(name)
        return gone

    def _change(self, name: str, loc: _Location, stored, evicted) -> None:
        for key in evicted:
            holders = self.blocks.get(key)
            if holders is not None:
                holders.discard(name)
                if not holders:
                    del self.blocks[key]
            loc.keys.discard(key)
        for key in stored:
            self.blocks.setdefault(key, set()).add(name)
            loc.keys.add(key)

    def _resync(self, name: str, loc: _Location, ev: CacheEvents) -> None:
        loc.buffered = [ev]
        self.resyncs += 1
        task = asyncio.create_task(self._sync(name, loc))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _sync(self, name: str, loc: _Location) -> None:
        snap = None
        try:
            reply = await self._nc.request(subjects.cache_sync(name), b"", timeout=self.sync_timeout_s)
            snap = decode(reply.data, CacheSnapshot)
        except Exception as exc:  # no answer: trust what we have, follow from the newest batch on
            log.warning("routing index: %s did not send its snapshot (%r)", name, exc)
        if self.locations.get(name) is not loc:
            return  # forgotten meanwhile
        buffered, loc.buffered = loc.buffered or [], None
        if snap is not None:
            self.load(snap)
            loc.retry_at, loc.retry_s = None, 0.0
        else:  # keep the keys we have (stale ones are misses), follow on from the newest message, ask again later
            newest = buffered[-1]
            loc.epoch, loc.seq = newest.epoch, newest.seq - (1 if newest.stored or newest.evicted else 0)
            buffered = [newest]
            loc.retry_s = min(2 * loc.retry_s, self.sync_retry_max_s) if loc.retry_s else self.sync_retry_s
            loc.retry_at = time.monotonic() + loc.retry_s
        for ev in buffered:
            if ev.epoch == loc.epoch and ev.seq > loc.seq:
                self.apply(ev)

    # ------------------------------------------------------------------------------------ queries

    def match(self, keys: list[bytes]) -> dict[str, int]:
        """location → how many of `keys`' leading blocks it holds (only locations holding ≥ 1)."""
        counts: dict[str, int] = {}
        holding: set[str] | None = None
        for i, key in enumerate(keys):
            here = self.blocks.get(key, set())
            now = set(here) if holding is None else holding & here
            if holding is not None:
                for name in holding - now:
                    counts[name] = i
            holding = now
            if not holding:
                break
        for name in holding or ():
            counts[name] = len(keys)
        return counts

    def summary(self) -> dict:
        return {"blocks": len(self.blocks), "resyncs": self.resyncs,
                "locations": {name: {"blocks": len(loc.keys), "seq": loc.seq, "epoch": loc.epoch,
                                     "silent_s": round(time.monotonic() - loc.heard, 3)}
                              for name, loc in sorted(self.locations.items())}}
