"""kvstore service + client against a real nats-server and valkey-server, the store in-process.

Tiny pools (8 slots of 4 KiB) so slot numbers and eviction order are exact; every test ends with
the pool's invariants checked and no block leased.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import nats
import pytest
import torch

from services.kvstore.config import KVStoreConfig
from services.kvstore.service import KVStoreService
from shared.kvcache.block_hash import ROOT_KEY, block_key
from shared.protocol import subjects
from shared.protocol.messages import (
    ErrorCode, KVBlockRef, KVLookupReply, KVRead, KVReadChunk, KVRelease, KVReply, KVStoreInfo, WorkerStats,
    decode, encode,
)
from shared.transport import valkey
from shared.transport.kv_client import KVChecksumError, KVStoreClient, KVStoreError

BLOCK_BYTES = 4096
BLOCK_SHAPE = (2, 2, 16, 2, 16)  # [L, 2, block_size, Hkv, Dh] in bf16 = 4096 bytes
LAYOUT = "L2.2.16.H2.D16.bfloat16"


def key(i: int) -> bytes:
    return block_key(ROOT_KEY, [i] * 16, "test-model")


def blocks(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, *BLOCK_SHAPE), generator=g).to(torch.bfloat16)


async def eventually(predicate, timeout: float = 3.0, what: str = "condition"):
    """Wait for a condition the service reaches in the background (polling; no fixed sleeps)."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


@pytest.fixture
async def nc(nats_server):
    conn = await nats.connect(nats_server.url)
    yield conn
    await conn.close()


@pytest.fixture
async def redis(valkey_server):
    client = valkey.connect(valkey_server.url)
    yield client
    await client.aclose()


@pytest.fixture
async def make_store(nats_server, valkey_server):
    """Start stores in-process (each an asyncio task); at the end check invariants, that nothing is
    leased, and that shutdown unlinked the shared memory."""
    running: list[tuple[KVStoreService, asyncio.Event, asyncio.Task]] = []

    async def make(**overrides) -> KVStoreService:
        settings = dict(block_bytes=BLOCK_BYTES, layout=LAYOUT, num_slots=8, store=f"t{uuid.uuid4().hex[:10]}",
                        nats_url=nats_server.url, redis_url=valkey_server.url, heartbeat_s=0.05, registry_ttl_s=2.0)
        settings.update(overrides)
        service = KVStoreService(KVStoreConfig(**settings))
        stop = asyncio.Event()
        task = asyncio.create_task(service.run(stop))
        ready = asyncio.create_task(service.ready.wait())
        await asyncio.wait([task, ready], return_when=asyncio.FIRST_COMPLETED, timeout=10)
        if task.done():
            task.result()  # start-up failed: show why
        assert service.ready.is_set()
        running.append((service, stop, task))
        return service

    yield make
    for service, stop, task in running:
        shm_name = service.memory.name
        try:
            service.pool.check_invariants()
            assert not service.pool.leases, f"leases left behind: {list(service.pool.leases)}"
            assert service.pool.num_in_use == 0
        finally:
            stop.set()
            await asyncio.wait_for(task, 10)
        if shm_name:
            assert not Path("/dev/shm", shm_name).exists(), "shutdown must unlink the segment"


@pytest.fixture
async def store(make_store):
    return await make_store()


async def client(nc, service: KVStoreService, **kwargs) -> KVStoreClient:
    c = KVStoreClient(nc, service.store, **kwargs)
    await c.attach(expected_layout=LAYOUT)
    return c


async def write_and_commit(c: KVStoreClient, data: torch.Tensor, keys: list[bytes]):
    reply = await c.allocate(len(keys), lease_ttl_s=30)
    checksums = await c.write_blocks(reply.lease_id, reply.slots, data)
    await c.commit(reply.lease_id, reply.slots, keys, checksums)
    return reply.lease_id, reply.slots, checksums


# ---------------------------------------------------------------------------------- data paths


@pytest.mark.parametrize("use_shm", [True, False], ids=["shm", "network"])
async def test_write_commit_lookup_read_roundtrip(store, nc, use_shm):
    writer = await client(nc, store, use_shm=use_shm)
    reader = await client(nc, store, use_shm=use_shm)
    assert writer.shm_attached == reader.shm_attached == use_shm
    info = writer.info
    assert (info.store, info.num_slots, info.block_bytes, info.block_size, info.layout) == (
        store.store, 8, BLOCK_BYTES, 16, LAYOUT)
    assert info.max_payload == nc.max_payload and info.shm_name == store.memory.name

    data = blocks(4)
    keys = [key(0), key(1), key(2), b""]  # three full blocks and a partial one
    lease, slots, checksums = await write_and_commit(writer, data, keys)
    assert slots == [0, 1, 2, 3]
    assert bytes(store.memory.view(2)) == data[2].view(torch.uint8).numpy().tobytes()  # landed in the pool

    hit = await reader.lookup([key(0), key(1), key(2), key(99)], lease_ttl_s=30)
    assert [(b.slot, b.checksum) for b in hit.blocks] == list(zip(slots[:3], checksums[:3]))
    assert hit.lease_id and hit.lease_id != lease
    out = torch.zeros(3, *BLOCK_SHAPE, dtype=torch.bfloat16)
    await reader.read_blocks(hit.lease_id, hit.blocks, out)
    assert torch.equal(out.view(torch.uint8), data[:3].view(torch.uint8))

    # the writer reads its own partial block back through its lease (out may be any dtype)
    partial = torch.zeros(1, BLOCK_BYTES, dtype=torch.uint8)
    await writer.read_blocks(lease, [KVBlockRef(3, checksums[3])], partial)
    assert torch.equal(partial[0], data[3].view(torch.uint8).flatten())

    assert store.pool.prefix_queries == 4 and store.pool.prefix_hits == 3
    await writer.release(lease)
    await reader.release(hit.lease_id)
    await writer.close()
    await reader.close()


async def test_network_path_chunks_blocks_larger_than_max_payload(make_store, nc):
    block_bytes = 3 * 2**20  # > 1 MiB default max_payload: several chunks per block, both ways
    service = await make_store(block_bytes=block_bytes, num_slots=2, layout="big")
    max_payload = nc.max_payload
    assert block_bytes > max_payload
    writes = []

    async def count_write(msg):  # a second subscriber sees every write request (and answers none)
        writes.append(len(msg.data))

    spy = await nc.subscribe(subjects.kv(service.store, "write"), cb=count_write)
    c = KVStoreClient(nc, service.store, use_shm=False)
    await c.attach()
    data = torch.randint(0, 256, (2, block_bytes), dtype=torch.uint8)
    lease, slots, checksums = await write_and_commit(c, data, [key(1), key(2)])
    await nc.flush()
    await spy.unsubscribe()
    assert len(writes) >= 2 * 4 and max(writes) <= max_payload  # 3 MiB in ≤ 960 KiB chunks: 4 a block

    # the raw stream: several chunks a slot, each under max_payload, `last` only on the final one
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish(subjects.kv(service.store, "read"), encode(KVRead(lease_id=lease, slots=slots)), reply=inbox)
    chunks = []
    while not chunks or not chunks[-1][1].last:
        msg = await sub.next_msg(timeout=5)
        chunks.append((len(msg.data), decode(msg.data, KVReadChunk)))
    await sub.unsubscribe()
    assert len(chunks) >= 8 and all(size <= max_payload for size, _ in chunks)
    assert [c.last for _, c in chunks].count(True) == 1
    for slot in slots:
        offsets = [c.offset for _, c in chunks if c.slot == slot]
        assert len(offsets) >= 4 and offsets == sorted(offsets)
        assert sum(len(c.data) for _, c in chunks if c.slot == slot) == block_bytes

    out = torch.empty_like(data)
    await c.read_blocks(lease, [KVBlockRef(s, x) for s, x in zip(slots, checksums)], out)
    assert torch.equal(out, data)
    await c.release(lease)


# -------------------------------------------------------------------------------------- leases


async def test_release_caches_full_blocks_and_frees_partial_ones(store, nc):
    c = await client(nc, store)
    lease, slots, _ = await write_and_commit(c, blocks(3), [key(0), key(1), b""])
    assert slots == [0, 1, 2] and store.pool.num_in_use == 3
    await c.release(lease)
    assert store.pool.num_in_use == 0 and store.pool.num_cached == 2  # slot 2 (partial) went back to free
    assert store.pool.pool.block_key[:3] == [key(0), key(1), None]
    hit = await c.lookup([key(0), key(1)])
    assert [b.slot for b in hit.blocks] == [0, 1]
    # a lookup lease can be extended with fresh slots (prefill: cached prefix + new blocks)
    more = await c.allocate(2, lease_id=hit.lease_id)
    assert more.lease_id == hit.lease_id and more.slots == [2, 3]
    assert store.pool.leases[hit.lease_id].slots == [0, 1, 2, 3]
    await c.release(hit.lease_id)
    with pytest.raises(KVStoreError) as err:
        await c.release(hit.lease_id)  # twice: refused, not a crash
    assert err.value.code == ErrorCode.BAD_REQUEST


async def test_lease_expires_unless_renewed(store, nc):
    c = await client(nc, store)
    start = time.monotonic()
    forgotten = await c.allocate(2, lease_ttl_s=0.3)
    kept = await c.allocate(1, lease_ttl_s=0.3)
    checksums = await c.write_blocks(forgotten.lease_id, forgotten.slots, blocks(2))
    await c.commit(forgotten.lease_id, forgotten.slots, [key(5), b""], checksums)
    await c.renew(kept.lease_id, 30.0)
    await eventually(lambda: forgotten.lease_id not in store.pool.leases, what="the lease to expire")
    assert time.monotonic() - start >= 0.3
    assert kept.lease_id in store.pool.leases  # renewed: still held
    assert store.pool.num_in_use == 1 and store.pool.num_cached == 1  # the keyed block stays cached
    with pytest.raises(KVStoreError) as err:
        await c.renew(forgotten.lease_id, 30.0)
    assert err.value.code == ErrorCode.BAD_REQUEST and "expired" in str(err.value)
    await c.release(kept.lease_id)


async def test_lru_eviction_order_and_overload(store, nc, redis):
    c = await client(nc, store)
    first, slots, _ = await write_and_commit(c, blocks(4), [key(i) for i in range(4)])
    assert slots == [0, 1, 2, 3]
    await c.release(first)  # tail first: LRU oldest → newest is 3, 2, 1, 0
    second = await c.allocate(4)
    assert second.slots == [4, 5, 6, 7]  # free slots before any eviction
    third = await c.allocate(2)
    assert third.slots == [3, 2]  # the least recently used cached blocks: the old request's tail
    hit = await c.lookup([key(i) for i in range(4)])
    assert [b.slot for b in hit.blocks] == [0, 1]  # key 2 was evicted: the prefix stops there

    with pytest.raises(KVStoreError) as err:
        await c.allocate(1)  # everything leased: nothing to evict
    assert err.value.code == ErrorCode.OVERLOADED and "leased" in str(err.value)
    for lease in (second.lease_id, third.lease_id, hit.lease_id):
        await c.release(lease)
    again = await c.allocate(1)  # the store is fine after refusing
    assert again.slots == [3]  # the last slot released without a key tops the free stack
    await c.release(again.lease_id)

    # routing hints follow: keys 0, 1 still point at this store, evicted 2, 3 no longer do
    async def hints():
        return [await redis.sismember(subjects.block_index_key(key(i)), store.store) for i in range(4)]

    await eventually(lambda: _equals(hints(), [1, 1, 0, 0]), what="routing hints after eviction")


async def _equals(awaitable, expected) -> bool:
    return list(await awaitable) == expected


# ----------------------------------------------------------------------------------- integrity


async def test_corrupt_block_raises_checksum_error(store, nc):
    writer = await client(nc, store)
    lease, slots, checksums = await write_and_commit(writer, blocks(2), [key(0), key(1)])
    store.memory.slots[slots[1], 100] ^= 0xFF  # bit rot after the commit
    refs = [KVBlockRef(s, x) for s, x in zip(slots, checksums)]
    for use_shm in (True, False):
        reader = await client(nc, store, use_shm=use_shm)
        with pytest.raises(KVChecksumError) as err:
            await reader.read_blocks(lease, refs, torch.empty(2, BLOCK_BYTES, dtype=torch.uint8))
        assert err.value.slot == slots[1] and err.value.code == ErrorCode.KV_TRANSFER_FAILED
        await reader.read_blocks(lease, refs[:1], torch.empty(1, BLOCK_BYTES, dtype=torch.uint8))  # slot 0 is fine
    await writer.release(lease)


async def test_refuses_writes_and_commits_outside_the_lease(store, nc):
    c = await client(nc, store, use_shm=False)
    mine = await c.allocate(1)
    other = await c.allocate(1)
    with pytest.raises(KVStoreError) as err:
        await c.write_blocks(mine.lease_id, other.slots, blocks(1))
    assert err.value.code == ErrorCode.BAD_REQUEST
    with pytest.raises(KVStoreError):
        await c.commit(mine.lease_id, other.slots, [key(1)], [0])
    checksums = await c.write_blocks(mine.lease_id, mine.slots, blocks(1))
    await c.commit(mine.lease_id, mine.slots, [key(1)], checksums)
    await c.commit(mine.lease_id, mine.slots, [key(1)], checksums)  # a retried commit is harmless
    with pytest.raises(KVStoreError):  # a committed (shared) block is read-only
        await c.write_blocks(mine.lease_id, mine.slots, blocks(1, seed=3))
    with pytest.raises(ValueError):
        await c.write_blocks(mine.lease_id, mine.slots, torch.zeros(1, BLOCK_BYTES + 1, dtype=torch.uint8))
    with pytest.raises(KVStoreError) as err:
        await c.allocate(1, lease_ttl_s=-1)
    assert err.value.code == ErrorCode.BAD_REQUEST
    for lease in (mine.lease_id, other.lease_id):
        await c.release(lease)


# ------------------------------------------------------------------------------ bad input, errors


async def test_malformed_messages_get_bad_request_and_the_store_keeps_working(store, nc):
    garbage = [b"\xc1", b"not msgpack at all", encode(KVRelease(lease_id="x"))[:-1]]
    wrong_type = encode(KVRead(lease_id="x", slots=[0]))  # decodes, but is not what the op expects
    for op in ("lookup", "allocate", "write", "commit", "release", "renew"):
        for body in [*garbage, wrong_type if op != "release" else encode(KVLookupReply())]:
            msg = await nc.request(subjects.kv(store.store, op), body, timeout=2)
            reply = decode(msg.data, KVReply)  # every typed reply has the same error fields
            assert reply.error_code == ErrorCode.BAD_REQUEST, (op, body, reply)
            assert reply.error
    for body in [*garbage, encode(KVLookupReply())]:
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        await nc.publish(subjects.kv(store.store, "read"), body, reply=inbox)
        chunk = decode((await sub.next_msg(timeout=2)).data, KVReadChunk)
        await sub.unsubscribe()
        assert chunk.error_code == ErrorCode.BAD_REQUEST and chunk.last
    for op, type_ in (("info", KVStoreInfo), ("stats", WorkerStats)):  # empty-body ops ignore the body
        decode((await nc.request(subjects.kv(store.store, op), b"\xc1", timeout=2)).data, type_)

    c = await client(nc, store)
    lease, slots, checksums = await write_and_commit(c, blocks(1), [key(7)])
    out = torch.empty(1, BLOCK_BYTES, dtype=torch.uint8)
    await c.read_blocks(lease, [KVBlockRef(slots[0], checksums[0])], out)
    await c.release(lease)


async def test_client_errors_name_the_store(store, nc):
    missing = KVStoreClient(nc, "no-such-store", timeout=0.5)
    with pytest.raises(KVStoreError) as err:
        await missing.attach()
    assert "no-such-store" in str(err.value) and err.value.code in (ErrorCode.INTERNAL, ErrorCode.TIMEOUT)
    with pytest.raises(KVStoreError) as err:
        await KVStoreClient(nc, store.store).attach(expected_layout="L30.2.16.H3.D64.bfloat16")
    assert err.value.code == ErrorCode.BAD_REQUEST and LAYOUT in str(err.value)
    c = await client(nc, store, use_shm=False)
    with pytest.raises(KVStoreError) as err:  # a read on an unknown lease comes back as an error chunk
        await c.read_blocks("nope", [KVBlockRef(0, 0)], torch.empty(1, BLOCK_BYTES, dtype=torch.uint8))
    assert err.value.code == ErrorCode.BAD_REQUEST


# --------------------------------------------------------------------------- stats, registry, hints


async def test_stats_registry_and_routing_hints(store, nc, redis):
    c = await client(nc, store)
    lease, slots, _ = await write_and_commit(c, blocks(2), [key(10), key(11)])
    await c.lookup([key(10), key(12)])  # 2 queried, 1 hit (leased below, released at the end)
    hit_lease = next(lid for lid in store.pool.leases if lid != lease)

    sub = await nc.subscribe(subjects.stats("kvstore", store.store))
    stats = decode((await sub.next_msg(timeout=2)).data, WorkerStats)
    stats = decode((await sub.next_msg(timeout=2)).data, WorkerStats)  # one published after the lookup
    await sub.unsubscribe()
    assert (stats.role, stats.instance, stats.kv_blocks_total, stats.kv_blocks_in_use, stats.kv_blocks_cached,
            stats.prefix_queries, stats.prefix_hits) == ("kvstore", store.store, 8, 2, 0, 2, 1)
    rpc = decode((await nc.request(subjects.kv(store.store, "stats"), b"", timeout=2)).data, WorkerStats)
    assert (rpc.kv_blocks_in_use, rpc.prefix_hits) == (2, 1)

    registry = subjects.registry_key("kvstore", store.store)
    await eventually(lambda: redis.exists(registry), what="the registry entry")
    entry = decode(await redis.get(registry), WorkerStats)
    assert entry.instance == store.store and 0 < await redis.pttl(registry) <= 2000
    for k in (key(10), key(11)):
        await eventually(lambda k=k: redis.sismember(subjects.block_index_key(k), store.store), what="SADD")
    assert not await redis.exists(subjects.block_index_key(key(12)))

    # Valkey loses everything (restart/flush): the store rewrites its registry entry and hints
    await redis.flushall()
    await eventually(lambda: redis.sismember(subjects.block_index_key(key(11)), store.store), what="resync")
    for lid in (lease, hit_lease):
        await c.release(lid)


async def test_shutdown_withdraws_from_valkey(make_store, nc, redis):
    service = await make_store()
    c = await client(nc, service)
    lease, _, _ = await write_and_commit(c, blocks(1), [key(20)])
    await c.release(lease)
    hint = subjects.block_index_key(key(20))
    await eventually(lambda: redis.sismember(hint, service.store), what="SADD")
    await c.close()
    await service.stop()
    assert not await redis.exists(subjects.registry_key("kvstore", service.store))
    assert not await redis.sismember(hint, service.store)
    assert not Path("/dev/shm", service.memory.name or "x").exists()


def test_main_runs_and_stops_on_sigterm(nats_server, valkey_server):
    """`python -m services.kvstore` as a real process: serves, then SIGTERM → drain, unlink, exit 0."""
    store = f"p{uuid.uuid4().hex[:10]}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.kvstore", "--store", store, "--block-bytes", "4096", "--layout", LAYOUT,
         "--num-slots", "4", "--nats", nats_server.url, "--redis", valkey_server.url],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=Path(__file__).parents[2],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )

    async def probe() -> KVStoreInfo:
        conn = await nats.connect(nats_server.url)
        try:
            deadline = time.monotonic() + 20
            while True:
                try:
                    return await KVStoreClient(conn, store, timeout=0.5).attach()
                except KVStoreError:
                    if time.monotonic() > deadline or proc.poll() is not None:
                        raise
                    await asyncio.sleep(0.05)
        finally:
            await conn.close()

    try:
        info = asyncio.run(probe())
        assert info.store == store and Path("/dev/shm", info.shm_name).exists()
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=10)[0].decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, output
    assert not Path("/dev/shm", info.shm_name).exists()
    assert "Traceback" not in output and "leaked" not in output, output


async def test_serves_without_valkey(make_store, nc):
    """Valkey holds hints only: with none reachable the store still serves and publishes stats."""
    from shared.transport.servers import free_port

    service = await make_store(redis_url=f"redis://127.0.0.1:{free_port()}")
    c = await client(nc, service)
    lease, slots, checksums = await write_and_commit(c, blocks(1), [key(30)])
    sub = await nc.subscribe(subjects.stats("kvstore", service.store))
    assert decode((await sub.next_msg(timeout=2)).data, WorkerStats).kv_blocks_in_use == 1
    await sub.unsubscribe()
    await eventually(lambda: service.heartbeat.num_pending_hints == 1, what="the hint to wait for Valkey")
    await c.release(lease)


async def test_stop_while_nats_is_unreachable(valkey_server):
    """The NATS connection retries forever at start-up; a stop then still ends the service cleanly."""
    from shared.transport.servers import free_port

    config = KVStoreConfig(block_bytes=BLOCK_BYTES, layout=LAYOUT, num_slots=2, store="unreachable",
                           nats_url=f"nats://127.0.0.1:{free_port()}", redis_url=valkey_server.url)
    service = KVStoreService(config)
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    await eventually(lambda: service.memory is not None, what="the pool to be created")
    shm_name = service.memory.name
    stop.set()
    await asyncio.wait_for(task, 5)
    assert not Path("/dev/shm", shm_name).exists()


async def test_stop_while_starting_ends_even_when_a_cancel_is_lost(valkey_server, monkeypatch):
    """A start that swallows a cancel (Python 3.11's asyncio.wait_for can, inside nats-py's connect
    loop) is cancelled again: the stop still ends the service."""
    config = KVStoreConfig(block_bytes=BLOCK_BYTES, layout=LAYOUT, num_slots=2, store="deaf",
                           nats_url="nats://127.0.0.1:1", redis_url=valkey_server.url)
    service = KVStoreService(config)
    cancels = []

    async def start_deaf_to_one_cancel():
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancels.append(1)
                if len(cancels) > 1:
                    raise

    monkeypatch.setattr(service, "start", start_deaf_to_one_cancel)
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    await asyncio.sleep(0.05)
    stop.set()
    await asyncio.wait_for(task, 5)
    assert len(cancels) == 2


def test_block_layout_comes_from_the_model(default_gguf):
    from services.kvstore.__main__ import build_parser, config_from_args

    config = config_from_args(build_parser().parse_args(["--model", str(default_gguf), "--dtype", "bfloat16",
                                                         "--store", "kv-a"]))
    # SmolLM2-135M: 30 layers, 3 KV heads of 64 → 11,520 values a token × 16 tokens × 2 bytes
    assert (config.block_bytes, config.layout) == (368_640, "L30.2.16.H3.D64.bfloat16")
    with pytest.raises(ValueError, match="subject token"):
        KVStoreConfig(block_bytes=1, layout="x", store="bad.name")


async def test_restarted_store_is_reattached_and_its_old_slots_never_read(make_store, nc):
    """The store dies and a new one takes its name with a new shared-memory segment. A client
    re-attaches when a reply names the new segment; a block reference into the old segment (a
    DecodeJob in flight across the restart) is refused, never read through the new mapping."""
    name = f"t{uuid.uuid4().hex[:10]}"
    first = await make_store(store=name)
    writer, reader = await client(nc, first), await client(nc, first)
    old_lease, old_slots, old_sums = await write_and_commit(writer, blocks(2, seed=1), [key(0), key(1)])
    old_refs = [KVBlockRef(s, c) for s, c in zip(old_slots, old_sums)]
    old_segment = first.memory.name
    await writer.release(old_lease)
    await first.stop()

    second = await make_store(store=name)
    assert second.memory.name != old_segment
    assert (await writer.lookup([key(0), key(1)])).blocks == []  # the new store starts empty
    data = blocks(2, seed=2)
    alloc = await writer.allocate(2)
    assert alloc.segment == second.memory.name and writer.info.shm_name == second.memory.name  # re-attached
    sums = await writer.write_blocks(alloc.lease_id, alloc.slots, data, segment=alloc.segment)
    await writer.commit(alloc.lease_id, alloc.slots, [key(2), key(3)], sums)

    # the reader still maps the old segment: a reference into the new one makes it re-attach
    out = torch.empty_like(data)
    await reader.read_blocks(alloc.lease_id, [KVBlockRef(s, c) for s, c in zip(alloc.slots, sums)], out,
                             segment=alloc.segment)
    assert torch.equal(out, data)
    # and a reference into the old segment is refused, whatever its slots hold now
    with pytest.raises(KVStoreError, match="gone"):
        await reader.read_blocks(old_lease, old_refs, torch.empty_like(data), segment=old_segment)
    await writer.release(alloc.lease_id)
