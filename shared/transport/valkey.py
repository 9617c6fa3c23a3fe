"""Valkey/Redis client helper: a client that retries on connection errors (the registry and the
block index are hints; a service must survive Valkey restarting or being flushed)."""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError


def connect(url: str, password: str | None = None) -> aioredis.Redis:
    return aioredis.Redis.from_url(
        url, password=password, socket_timeout=2.0, socket_connect_timeout=2.0,
        retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=3),
        retry_on_error=[RedisConnectionError, RedisTimeoutError], health_check_interval=5,
    )
