"""Valkey with a replica and 3 sentinels, real processes: a client given the sentinels follows a
failover (the primary SIGKILLed → the replica promoted) with no change on its side."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest
from redis.exceptions import RedisError

from shared.transport import valkey
from shared.transport.servers import sentinel_url, start_valkey_ha


def test_sentinel_urls_parse_and_bad_ones_are_refused():
    assert valkey.parse_sentinel_url("redis+sentinel://a:1,b:2/pdserve") == ([("a", 1), ("b", 2)], "pdserve")
    with pytest.raises(ValueError, match="primary name"):
        valkey.parse_sentinel_url("redis+sentinel://a:1")
    with pytest.raises(ValueError, match="host:port"):
        valkey.parse_sentinel_url("redis+sentinel://a/pdserve")


async def _until(probe, what: str, bound: float = 30.0):
    deadline = time.monotonic() + bound
    while True:
        try:
            value = await probe()
            if value:
                return value
        except RedisError:
            pass
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


@pytest.mark.slow
async def test_a_client_of_the_sentinels_follows_a_failover(tmp_path):
    servers = await asyncio.to_thread(start_valkey_ha, tmp_path, password="s3cret")
    primary, replica, sentinels = servers[0], servers[1], servers[2:]
    client = valkey.connect(sentinel_url(sentinels), "s3cret")
    try:
        await client.set("pd:test:before", "1")
        # the replica has it before the primary goes (what the registry holds survives the failover)
        direct = valkey.connect(f"redis://127.0.0.1:{replica.port}", "s3cret")
        await _until(lambda: direct.get("pd:test:before"), "the replica to sync")
        primary.proc.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        # the same client object: writes go to the promoted replica once the sentinels agree
        await _until(lambda: client.set("pd:test:after", "2"), "a write after the failover", 30)
        took = time.monotonic() - t0
        assert (await direct.info("replication"))["role"] == "master"
        assert await client.get("pd:test:before") == b"1" and await direct.get("pd:test:after") == b"2"
        print(f"\nfailover: writes resumed {took:.1f} s after the primary was killed")
        await direct.aclose()
    finally:
        await client.aclose()
        for server in servers:
            server.stop()
