"""Liveness and load: `WorkerStats` on NATS every `interval` (the gateway's /metrics, and its router's
view of each worker's load: a stale one routes the next request by a load already gone, so this is
frequent), and a registry entry with a TTL in Valkey every `registry_interval` (the gateway's
/health). Either may be down for a while: errors are logged and the next tick tries again."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from shared.protocol import subjects
from shared.protocol.messages import WorkerStats, encode

log = logging.getLogger(__name__)


async def publish_stats(nc, s: WorkerStats) -> bytes:
    """Stamp and publish one WorkerStats on pd.stats.<role>.<inst>; returns it encoded."""
    s.ts = time.time()
    data = encode(s)
    try:
        await nc.publish(subjects.stats(s.role, s.instance), data)
    except Exception as exc:
        log.warning("stats publish failed: %s", exc)
    return data


async def heartbeat(nc, redis, stats: Callable[[], WorkerStats], stop: asyncio.Event,
                    interval: float = 0.25, registry_interval: float = 1.0, ttl: float = 5.0) -> None:
    registered = float("-inf")
    while not stop.is_set():
        s = stats()
        data = await publish_stats(nc, s)
        if redis is not None and time.monotonic() - registered >= registry_interval:
            registered = time.monotonic()
            try:
                await redis.set(subjects.registry_key(s.role, s.instance), data, px=int(ttl * 1000))
            except Exception as exc:
                log.warning("registry update failed: %s", exc)
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except asyncio.TimeoutError:
            pass
    if redis is not None:  # leave the registry at once on a clean exit
        try:
            s = stats()
            await redis.delete(subjects.registry_key(s.role, s.instance))
        except Exception as exc:
            log.warning("registry removal failed: %s", exc)
