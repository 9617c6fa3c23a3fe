"""Valkey/Redis client helper: a client that retries on connection errors (the registry and the
block index are hints; a service must survive Valkey restarting or being flushed).

    redis://host:6379                                   one server
    redis+sentinel://s1:26379,s2:26379,s3:26379/NAME    the primary the sentinels know as NAME: asked
                                                        again at every reconnect, so a client follows
                                                        a failover to the promoted replica
"""

from __future__ import annotations

from urllib.parse import urlsplit

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError
from redis.exceptions import TimeoutError as RedisTimeoutError

SENTINEL_SCHEMES = ("redis+sentinel", "valkey+sentinel")


def _client_options() -> dict:
    return dict(socket_timeout=2.0, socket_connect_timeout=2.0,
                retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=3),
                # READONLY: a connection made to the old primary, now a replica, before the failover
                retry_on_error=[RedisConnectionError, RedisTimeoutError, ReadOnlyError], health_check_interval=5)


def parse_sentinel_url(url: str) -> tuple[list[tuple[str, int]], str]:
    """`redis+sentinel://h1:p1,h2:p2/NAME` → ([(h1, p1), (h2, p2)], NAME)."""
    parts = urlsplit(url)
    hosts = []
    for hostport in parts.netloc.rsplit("@", 1)[-1].split(","):
        host, _, port = hostport.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"sentinel address {hostport!r} in {url!r} is not host:port")
        hosts.append((host, int(port)))
    name = parts.path.strip("/")
    if not name:
        raise ValueError(f"no primary name in {url!r} (redis+sentinel://host:port,…/NAME)")
    return hosts, name


def connect(url: str, password: str | None = None) -> aioredis.Redis:
    if urlsplit(url).scheme in SENTINEL_SCHEMES:
        hosts, name = parse_sentinel_url(url)
        sentinel = Sentinel(hosts, socket_timeout=1.0, socket_connect_timeout=1.0)
        return sentinel.master_for(name, password=password, **_client_options())
    return aioredis.Redis.from_url(url, password=password, **_client_options())
