"""Which workers are alive, seen from the gateway.

Two sources, either is enough: the `WorkerStats` every worker publishes on pd.stats.<role>.<inst>
each heartbeat (kept in memory with their arrival time), and the registry keys
pd:worker:<role>:<inst> that workers keep alive in Valkey with a TTL. The stats also feed /metrics.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import msgspec
import redis.asyncio as aioredis
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg as NatsMsg
from redis.exceptions import RedisError

from shared.protocol import subjects
from shared.protocol.messages import WorkerStats, decode

log = logging.getLogger(__name__)


@dataclass
class _Heard:
    stats: WorkerStats
    at: float  # time.monotonic() of arrival (worker clocks are not compared with ours)


class WorkerView:
    def __init__(self, redis: aioredis.Redis, *, alive_s: float = 5.0, stats_ttl_s: float = 10.0,
                 registry_cache_s: float = 1.0) -> None:
        self._redis = redis
        self._alive_s = alive_s
        self._stats_ttl_s = stats_ttl_s
        self._registry_cache_s = registry_cache_s
        self._scan_timeout_s = 1.0  # a slow Valkey must not stall every request's health check
        self._heard: dict[tuple[str, str], _Heard] = {}
        self._registry: set[tuple[str, str]] = set()
        self._registry_at = float("-inf")
        self._registry_lock = asyncio.Lock()
        self._sub = None

    async def start(self, nc: NATS) -> None:
        self._sub = await nc.subscribe(subjects.STATS_ALL, cb=self._on_stats)

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None

    async def _on_stats(self, msg: NatsMsg) -> None:
        try:
            stats = decode(msg.data, WorkerStats)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("undecodable WorkerStats on %s dropped: %s", msg.subject, exc)
            return
        self._heard[(stats.role, stats.instance)] = _Heard(stats, time.monotonic())

    def recent_stats(self) -> list[WorkerStats]:
        """Latest stats of every instance heard from within `stats_ttl_s` (older ones are forgotten)."""
        now = time.monotonic()
        for key in [k for k, h in self._heard.items() if now - h.at > self._stats_ttl_s]:
            del self._heard[key]
        return [h.stats for h in self._heard.values()]

    def live(self, role: str) -> list[WorkerStats]:
        """Latest stats of each instance of `role` heartbeating now (the router's candidates)."""
        now = time.monotonic()
        return [h.stats for (r, _), h in self._heard.items() if r == role and now - h.at <= self._alive_s]

    def heard_at(self, role: str, instance: str) -> float:
        """time.monotonic() when the latest stats of this instance arrived (-inf: never)."""
        heard = self._heard.get((role, instance))
        return heard.at if heard is not None else float("-inf")

    def silent_for(self, instance: str) -> float:
        """How long `instance` has been silent while others were heard: seconds between its last
        stats and the latest stats from any instance (inf if never heard of). Relative, so a pause
        on our side (NATS restarting, this process stalled) silences everyone alike and kills no one."""
        at = max((h.at for (_, inst), h in self._heard.items() if inst == instance), default=None)
        if at is None:
            return float("inf")
        return max(h.at for h in self._heard.values()) - at

    def role_of(self, instance: str) -> str | None:
        """The role `instance` heartbeats as (None if never heard of)."""
        return next((role for role, inst in self._heard if inst == instance), None)

    def _heartbeating(self) -> set[tuple[str, str]]:
        now = time.monotonic()
        return {k for k, h in self._heard.items() if now - h.at <= self._alive_s}

    async def _registered(self) -> set[tuple[str, str]]:
        """Registry keys in Valkey, rescanned at most every `registry_cache_s`."""
        async with self._registry_lock:
            if time.monotonic() - self._registry_at < self._registry_cache_s:
                return self._registry
            try:
                async with asyncio.timeout(self._scan_timeout_s):
                    found = await self._scan()
            except (RedisError, OSError, TimeoutError) as exc:  # TimeoutError: Valkey too slow to matter
                log.warning("worker registry scan failed (relying on stats heartbeats): %r", exc)
                found = set()
            self._registry, self._registry_at = found, time.monotonic()
            return found

    async def _scan(self) -> set[tuple[str, str]]:
        found = set()
        async for key in self._redis.scan_iter(match=subjects.REGISTRY_PATTERN, count=500):
            parts = (key.decode() if isinstance(key, bytes) else key).split(":", 3)  # pd:worker:<role>:<inst>
            if len(parts) == 4:
                found.add((parts[2], parts[3]))
        return found

    async def alive(self, roles: frozenset[str] | None = None) -> dict[str, list[str]]:
        """role → live instances. Skips the Valkey scan when heartbeats already cover `roles`."""
        live = self._heartbeating()
        if roles is None or not roles <= {role for role, _ in live}:
            live |= await self._registered()
        out: dict[str, list[str]] = {}
        for role, instance in sorted(live):
            out.setdefault(role, []).append(instance)
        return out

    async def missing_roles(self, required: frozenset[str]) -> tuple[list[str], dict[str, list[str]]]:
        alive = await self.alive(required)
        return sorted(r for r in required if not alive.get(r)), alive
