"""The routing index (services/gateway/prefix_index.py), its feed (shared/transport/cache_events.py)
and the router (services/gateway/router.py): fast tests. The index runs against real NATS and Valkey;
the router against stats and an index we set. End-to-end routing through `pdserve up` is in
tests/services/test_routing_e2e.py."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest

from services.gateway.config import GatewayConfig
from services.gateway.prefix_index import PrefixIndex
from services.gateway.router import HOT_MIN_REQUESTS, Router
from shared.kvcache.block_hash import block_keys
from shared.kvcache.block_pool import BlockPool
from shared.protocol import subjects
from shared.protocol.messages import CacheEvents, WorkerStats
from shared.transport import nats_bus, valkey
from shared.transport.cache_events import CachePublisher

MODEL_ID = "test-model.gguf"
BS = 16


def keys(tokens: list[int]) -> list[bytes]:
    return block_keys(tokens, BS, MODEL_ID)


def ev(loc: str, seq: int, stored=(), evicted=(), epoch: str = "e1", gone: bool = False) -> CacheEvents:
    return CacheEvents(location=loc, epoch=epoch, seq=seq, stored=list(stored), evicted=list(evicted), gone=gone)


# ------------------------------------------------------------------------------------ the index


def test_match_counts_leading_blocks_per_location():
    k = keys(list(range(6 * BS)))
    index = PrefixIndex()
    index.apply(ev("worker.a", 1, k[:4]))
    index.apply(ev("store.h1", 1, k[:2] + k[3:6]))  # holds 0, 1, then a hole at 2
    index.apply(ev("worker.b", 1, k[1:3]))  # no block 0: holds no prefix of this prompt
    assert index.match(k) == {"worker.a": 4, "store.h1": 2}
    assert index.match(k[:1]) == {"worker.a": 1, "store.h1": 1}
    assert index.match(keys([9] * BS)) == {}
    index.apply(ev("worker.a", 2, evicted=k[2:3]))
    assert index.match(k)["worker.a"] == 2


async def test_duplicates_keepalives_and_a_restart_are_handled_without_a_snapshot():
    k = keys(list(range(3 * BS)))
    index = PrefixIndex(sync_retry_s=0.1)
    index.apply(ev("worker.a", 0))  # keepalive of a location with nothing yet
    index.apply(ev("worker.a", 1, k[:2]))
    index.apply(ev("worker.a", 1, k[:3]))  # a duplicate of batch 1: ignored
    index.apply(ev("worker.a", 1))  # keepalive
    assert index.match(k) == {"worker.a": 2}
    index.apply(ev("worker.a", 2))  # a keepalive ahead of us: batch 2 was lost → ask for the snapshot
    assert index.locations["worker.a"].buffered is not None and index.resyncs == 1
    await asyncio.sleep(0.05)  # nobody answers (no NATS here): keep what we have, follow from seq 2 on
    assert index.locations["worker.a"].buffered is None and index.locations["worker.a"].seq == 2
    assert index.resyncs == 1 and index.match(k) == {"worker.a": 2}
    index.apply(ev("worker.a", 3, k[2:3]))  # followed on; the snapshot is asked for again only later
    assert index.resyncs == 1 and index.match(k) == {"worker.a": 3}
    await asyncio.sleep(0.1)
    index.apply(ev("worker.a", 3))  # a keepalive after the retry time: ask again (and again later: 0.2 s)
    assert index.resyncs == 2 and index.locations["worker.a"].buffered is not None
    await asyncio.sleep(0.05)
    assert index.locations["worker.a"].retry_s == 0.2 and index.match(k) == {"worker.a": 3}
    index.apply(ev("worker.a", 1, k[:1], epoch="e2"))  # restarted: starts empty, first batch applies
    assert index.match(k) == {"worker.a": 1}
    index.apply(ev("worker.a", 2, gone=True, epoch="e2"))
    assert index.match(k) == {} and not index.blocks and not index.locations


def test_silent_locations_are_forgotten():
    k = keys(list(range(BS)))
    index = PrefixIndex(forget_after_s=0.05)
    index.apply(ev("worker.a", 1, k))
    index.locations["worker.a"].heard -= 1.0
    assert index.prune() == ["worker.a"]
    assert index.match(k) == {}


async def test_follows_a_publisher_resyncs_after_a_gap_and_a_restarted_gateway_rebuilds(nats_server,
                                                                                       valkey_server):
    """A real feed: a BlockPool → CachePublisher → NATS → PrefixIndex; events lost (a gap) send the
    index to the location's snapshot; a second index started later rebuilds from Valkey + events."""
    nc = await nats_bus.connect(nats_server.url, "test-routing")
    redis = valkey.connect(valkey_server.url)
    pool = BlockPool(64)
    queue = pool.add_event_queue()
    loc = subjects.cache_location("worker", "routing-test-a")

    reads = []

    async def read_keys() -> list[bytes]:
        reads.append(len(pool.cached_keys()))
        return pool.cached_keys()

    pub = CachePublisher(nc, redis, loc, lambda: pool.take_events(queue), read_keys)
    await pub.start()
    index = PrefixIndex()
    await index.start(nc, redis)

    def cache(tokens: list[int]) -> list[bytes]:
        ks = keys(tokens)
        for block, key in zip(pool.allocate(len(ks)), ks):
            pool.cache_block(block, key)
        return ks

    async def settled(expected: dict[str, int], k: list[bytes], idx: PrefixIndex = index) -> None:
        for _ in range(100):
            if {n: c for n, c in idx.match(k).items() if n == loc} == expected:
                return
            await asyncio.sleep(0.02)
        assert {n: c for n, c in idx.match(k).items() if n == loc} == expected

    try:
        a = cache(list(range(4 * BS)))
        await pub.publish_changes()
        await settled({loc: 4}, a)
        # a gap: batch 2 is lost on the wire
        b = cache([7] * (2 * BS))
        send, pub._send = pub._send, lambda events: asyncio.sleep(0)
        await pub.publish_changes()
        pub._send = send
        c = cache([8] * BS)
        await pub.publish_changes()  # batch 3: the index sees seq 3 after 1 and asks for the snapshot
        await settled({loc: 2}, b)
        await settled({loc: 1}, c)
        assert index.resyncs == 1
        await pub.write_snapshot()
        # a gateway starting now: the snapshot in Valkey, then the events after it
        d = cache([9] * (3 * BS))
        later = PrefixIndex()
        await later.start(nc, redis)
        await settled({loc: 4}, a, later)
        await pub.publish_changes()
        await settled({loc: 3}, d, later)
        assert later.resyncs == 0  # the snapshot's seq and the next batch line up
        # the pool was read once, at start: a snapshot is the publisher's own copy of the keys, so it
        # never waits for the pool's owner (an engine between steps)
        assert reads == [0]
        # the location leaves: every index forgets it, and its snapshot is gone from Valkey
        await pub.withdraw()
        await settled({}, a, later)
        await settled({}, a)
        assert await redis.get(subjects.cache_snapshot_key(loc)) is None
        await later.stop()
    finally:
        await index.stop()
        await redis.delete(subjects.cache_snapshot_key(loc))
        await redis.aclose()
        await nc.close()


# ----------------------------------------------------------------------------------- the router


class Fleet:
    """Live workers' stats as the gateway would have them, and an index we fill by hand."""

    def __init__(self, role: str, names: list[str], kvstore: dict[str, str] | None = None):
        self.stats = {n: WorkerStats(role=role, instance=n, kvstore=(kvstore or {}).get(n, "")) for n in names}
        self.extra: dict[str, list[WorkerStats]] = {}

    def live(self, role: str) -> list[WorkerStats]:
        return [s for s in self.stats.values() if s.role == role] + self.extra.get(role, [])


def make_router(fleet: Fleet, index: PrefixIndex, **config) -> Router:
    return Router(GatewayConfig(**config), index, fleet.live, MODEL_ID, BS)


def prompt(doc: int, n: int) -> list[int]:
    return [1000 + doc] * n


def held_by_w1(doc: int, blocks: int) -> tuple[Fleet, list[int], Router]:
    """Two colocated workers, w0 and w1; a prompt of `blocks` blocks whose KV w1's engine holds."""
    fleet, index, p = Fleet("colocated", ["w0", "w1"]), PrefixIndex(), prompt(doc, blocks * BS)
    index.apply(ev("worker.w1", 1, keys(p)))
    return fleet, p, make_router(fleet, index, mode="colocated")


def test_cache_aware_goes_to_the_holder_and_spills_over_when_it_is_hot():
    fleet, p, router = held_by_w1(1, 40)
    r = router.route(p)
    assert (r.target, r.reason, r.subject) == ("w1", "cache", subjects.worker_jobs(subjects.PREFILL_JOBS, "w1"))
    assert r.cached_tokens == 39 * BS  # the block holding the last token is computed (a worker computes ≥ 1 token)
    router.taken(r)
    # w1 gets busy: still the holder while it has few more requests than w0 …
    fleet.stats["w1"].running = HOT_MIN_REQUESTS - 1
    assert router.route(p).target == "w1"
    # … and while it is within the hot-spot factor of the mean …
    fleet.stats["w1"].running, fleet.stats["w0"].running = 10, 6
    assert router.route(p).target == "w1"
    # … but not once it is both: the prefix spreads to the other worker (which must compute it)
    fleet.stats["w1"].running, fleet.stats["w0"].running = 10, 1
    r = router.route(p)
    assert (r.target, r.reason, r.cached_tokens) == ("w0", "hot-spot", 0)
    # a holder whose load in tokens is well above the other's still wins while the cost says so:
    # its running sequences weigh far less than computing the prompt again
    fleet.stats["w1"].running, fleet.stats["w0"].running = 3, 0
    fleet.stats["w1"].kv_blocks_in_use = 3 * 60
    assert router.route(p).target == "w1"


def test_zero_reuse_spreads_like_least_loaded():
    fleet = Fleet("colocated", ["w0", "w1", "w2"])
    counts = {}
    for policy in ("cache-aware", "least-loaded"):
        router = make_router(fleet, PrefixIndex(), mode="colocated", router=policy)
        got = Counter()
        for i in range(90):  # nobody takes the jobs: pending load alone must spread them
            got[router.route(prompt(i, 300 + 10 * (i % 7))).target] += 1
        counts[policy] = got
        assert max(got.values()) <= 1.3 * 90 / 3, got
    assert counts["cache-aware"] == counts["least-loaded"]


def test_round_robin_ignores_cache_and_load():
    fleet = Fleet("prefill", ["p0", "p1"])
    index = PrefixIndex()
    p = prompt(3, 10 * BS)
    index.apply(ev("worker.p0", 1, keys(p)))
    router = make_router(fleet, index, router="round-robin")
    assert [router.route(p).target for _ in range(4)] in (["p0", "p1"] * 2, ["p1", "p0"] * 2)


def test_a_prefill_worker_counts_its_host_store_as_its_cache():
    fleet = Fleet("prefill", ["p0", "p1"], kvstore={"p0": "kv-h0", "p1": "kv-h1"})
    index = PrefixIndex()
    p = prompt(4, 20 * BS)
    index.apply(ev("store.kv-h1", 1, keys(p)[:12]))
    index.apply(ev("worker.p0", 1, keys(p)[:3]))
    r = make_router(fleet, index).route(p)
    assert (r.target, r.cached_tokens) == ("p1", 12 * BS)


def test_a_draining_worker_gets_no_jobs_even_for_its_cache():
    fleet, p, router = held_by_w1(6, 20)
    assert router.route(p).target == "w1"
    fleet.stats["w1"].draining = True  # the autoscaler is removing it (or `up` is stopping)
    assert {router.route(p).target for _ in range(4)} == {"w0"}
    fleet.stats["w0"].draining = True
    assert router.route(p).subject == subjects.PREFILL_JOBS  # none left to choose: the shared queue


def test_no_live_worker_known_falls_back_to_the_shared_queue():
    router = make_router(Fleet("prefill", []), PrefixIndex())
    r = router.route(prompt(5, 100))
    assert (r.subject, r.target, r.reason) == (subjects.PREFILL_JOBS, "", "shared")


def test_conditional_decides_per_request_from_the_uncached_length_and_the_prefill_queue():
    fleet = Fleet("decode", ["d0"])
    fleet.extra["prefill"] = [WorkerStats(role="prefill", instance="p0")]
    index = PrefixIndex()
    router = make_router(fleet, index, mode="conditional", conditional_threshold=256,
                         conditional_busy_threshold=1024, conditional_queue_tokens=2000)
    short, long_ = prompt(6, 100), prompt(7, 3000)
    assert (router.route(short).pool, router.route(short).reason) == ("decode", "short")
    r = router.route(long_)
    assert (r.pool, r.target, r.reason) == ("prefill", "p0", "long")
    # the same long prompt, now cached at the decode worker (its earlier turns): mostly cached → decode
    index.apply(ev("worker.d0", 1, keys(long_)[:180]))
    r = router.route(long_)
    assert (r.pool, r.target, r.reason, r.cached_tokens) == ("decode", "d0", "cached", 180 * BS)
    # a medium prompt goes to prefill while its queue is short, to decode once it is long
    medium = prompt(8, 600)
    router.pending.clear()
    assert router.route(medium).pool == "prefill"
    fleet.extra["prefill"][0].queued_tokens = 5000
    r = router.route(medium)
    assert (r.pool, r.reason) == ("decode", "busy")


def test_pending_load_counts_until_a_report_made_after_the_job_was_taken():
    fleet = Fleet("prefill", ["p0"])
    heard = {"p0": 0.0}
    router = Router(GatewayConfig(), PrefixIndex(), fleet.live, MODEL_ID, BS, heard_at=lambda role, i: heard[i])
    r = router.route(prompt(9, 500))
    r2 = router.route(prompt(10, 300))
    s = fleet.stats["p0"]
    assert router.pending_tokens(s) == 800
    router.taken(r)
    heard["p0"] = time.monotonic() - 1.0  # a report from before it took the job: still pending
    assert router.pending_tokens(s) == 800
    heard["p0"] = time.monotonic() + 1.0  # a report made after: it is in the worker's own count now
    assert router.pending_tokens(s) == 300
    router.taken(r2)
    router.taken(r2)  # a second call (the channel closing) changes nothing
    heard["p0"] = time.monotonic() + 2.0
    assert router.pending_tokens(s) == 0 and router.pending == {}


@pytest.mark.parametrize("bad", ["a.b", "x*", "", "a b"])
def test_names_that_cannot_be_subject_tokens_are_refused(bad):
    with pytest.raises(ValueError):
        subjects.worker_jobs(subjects.PREFILL_JOBS, bad)
