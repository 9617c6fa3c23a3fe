"""The store's index: `BlockPool` (refcounts, prefix cache, LRU eviction, events) plus leases.

A lease is how anyone outside the store holds blocks. It is a list of slots holding one pool
reference each, and a deadline: `renew` moves the deadline, `release` (or `expire`, once the
deadline passes) drops every reference. A crashed worker therefore pins blocks for at most one
lease TTL. No reference is taken any other way, so

    pool.ref_counts[s] == number of leases listing s        (check_invariants)

A lease *owns* the slots it allocated: only those may be written and committed. Slots a lease got
from a lookup are shared with other readers and are read-only. Committing a slot under a key puts
it in the prefix cache (indexed); once its last lease lets go it waits on the LRU list until a hit
takes it or an allocation evicts it. A slot committed with key b"" (a request's partial last
block) is private and returns to the free list on release.

Pure bookkeeping: no I/O, no asyncio; the clock is injectable for tests.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from shared.kvcache.block_pool import BlockEvicted, BlockPool, BlockStored
from shared.protocol.messages import ErrorCode, KVBlockRef

log = logging.getLogger(__name__)

KEY_BYTES = 16  # block keys are 128-bit digests (DESIGN.md)
_CHECKSUM_LIMIT = 1 << 64  # XXH3-64 (shared/transport/kv_client.checksum)


class PoolError(Exception):
    """A request the pool refuses; travels back as (code, message)."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code = code


@dataclass
class Lease:
    lease_id: str
    deadline: float  # on the pool's clock (monotonic seconds)
    slots: list[int] = field(default_factory=list)  # one pool reference each, in the order taken
    owned: set[int] = field(default_factory=set)  # allocated by this lease: writable, committable


class SlotPool:
    def __init__(self, num_slots: int, *, max_lease_ttl_s: float = 3600.0,
                 clock: Callable[[], float] = time.monotonic):
        self.pool = BlockPool(num_slots)
        self._hints = self.pool.add_event_queue()  # the Valkey routing hints (heartbeat.py)
        self.num_slots = num_slots
        self.checksums = [0] * num_slots  # XXH3-64 recorded at commit
        self.leases: dict[str, Lease] = {}
        self.max_lease_ttl_s = max_lease_ttl_s
        self.clock = clock
        self.prefix_queries = 0  # blocks looked up
        self.prefix_hits = 0  # blocks found

    # ------------------------------------------------------------------------------------ queries

    @property
    def num_in_use(self) -> int:
        return self.pool.num_used_blocks

    @property
    def num_cached(self) -> int:
        return self.pool.num_cached_blocks

    def lease(self, lease_id: str) -> Lease:
        lease = self.leases.get(lease_id)
        if lease is None:
            raise PoolError(ErrorCode.BAD_REQUEST, f"unknown lease {lease_id!r} (released or expired)")
        return lease

    def check_readable(self, lease_id: str, slots: list[int]) -> Lease:
        lease = self.lease(lease_id)
        held = set(lease.slots)
        for slot in slots:
            if slot not in held:
                raise PoolError(ErrorCode.BAD_REQUEST, f"slot {slot} is not held by lease {lease_id}")
        return lease

    def check_writable(self, lease_id: str, slot: int) -> Lease:
        lease = self.lease(lease_id)
        if slot not in lease.owned:
            raise PoolError(ErrorCode.BAD_REQUEST, f"slot {slot} was not allocated by lease {lease_id}")
        if self.pool.block_key[slot] is not None:
            raise PoolError(ErrorCode.BAD_REQUEST, f"slot {slot} is committed and shared: it is read-only")
        return lease

    def next_deadline(self) -> float | None:
        return min((lease.deadline for lease in self.leases.values()), default=None)

    # ---------------------------------------------------------------------------------- mutations

    def lookup(self, keys: list[bytes], ttl_s: float) -> tuple[str, list[KVBlockRef]]:
        """Lease the longest cached prefix of `keys`; ("", []) when the first key misses."""
        self._check_ttl(ttl_s)
        for key in keys:
            if len(key) != KEY_BYTES:
                raise PoolError(ErrorCode.BAD_REQUEST, f"block keys are {KEY_BYTES} bytes, got {len(key)}")
        hits = self.pool.match_prefix(keys)
        self.prefix_queries += len(keys)
        self.prefix_hits += len(hits)
        if not hits:
            return "", []
        self.pool.acquire(hits)
        lease = self._new_lease(ttl_s)
        lease.slots.extend(hits)
        return lease.lease_id, [KVBlockRef(slot, self.checksums[slot]) for slot in hits]

    def allocate(self, num_blocks: int, ttl_s: float, lease_id: str = "") -> tuple[str, list[int]]:
        """Take `num_blocks` slots (free ones first, then evicting least-recently-used cached ones)
        into a new lease, or into `lease_id`."""
        self._check_ttl(ttl_s)
        if not 1 <= num_blocks <= self.num_slots:
            raise PoolError(ErrorCode.BAD_REQUEST, f"num_blocks must be in [1, {self.num_slots}], got {num_blocks}")
        lease = self.lease(lease_id) if lease_id else None
        if not self.pool.can_allocate(num_blocks):
            raise PoolError(ErrorCode.OVERLOADED,
                            f"asked for {num_blocks} blocks, {self.pool.num_free_blocks} of {self.num_slots} "
                            "are free or evictable (the rest are leased)")
        if lease is None:
            lease = self._new_lease(ttl_s)
        else:
            lease.deadline = max(lease.deadline, self.clock() + ttl_s)
        slots = self.pool.allocate(num_blocks)
        lease.slots.extend(slots)
        lease.owned.update(slots)
        return lease.lease_id, slots

    def commit(self, lease_id: str, slots: list[int], keys: list[bytes], checksums: list[int]) -> None:
        """Record checksums and index the slots that have keys. All-or-nothing: every slot is
        checked before anything changes."""
        lease = self.lease(lease_id)
        if not len(slots) == len(keys) == len(checksums):
            raise PoolError(ErrorCode.BAD_REQUEST, f"commit needs one key and one checksum per slot, got "
                                                   f"{len(slots)} slots, {len(keys)} keys, {len(checksums)} checksums")
        if len(set(slots)) != len(slots):
            raise PoolError(ErrorCode.BAD_REQUEST, "commit lists a slot twice")
        for slot, key, checksum in zip(slots, keys, checksums):
            if slot not in lease.owned:
                raise PoolError(ErrorCode.BAD_REQUEST, f"slot {slot} was not allocated by lease {lease_id}")
            if len(key) not in (0, KEY_BYTES):
                raise PoolError(ErrorCode.BAD_REQUEST, f"block keys are {KEY_BYTES} bytes (b'' for a partial "
                                                       f"block), got {len(key)}")
            if not 0 <= checksum < _CHECKSUM_LIMIT:
                raise PoolError(ErrorCode.BAD_REQUEST, f"checksum {checksum} is not a 64-bit unsigned int")
            indexed_key = self.pool.block_key[slot]
            if indexed_key is not None and (indexed_key != key or self.checksums[slot] != checksum):
                raise PoolError(ErrorCode.BAD_REQUEST, f"slot {slot} is already committed under another "
                                                       "key or checksum")
        for slot, key, checksum in zip(slots, keys, checksums):
            if self.pool.block_key[slot] is not None:
                continue  # a retried commit: already indexed with these exact values
            self.checksums[slot] = checksum
            if key:
                self.pool.cache_block(slot, key)  # a key already cached elsewhere leaves this slot private

    def renew(self, lease_id: str, ttl_s: float) -> None:
        self._check_ttl(ttl_s)
        lease = self.lease(lease_id)
        lease.deadline = self.clock() + ttl_s

    def release(self, lease_id: str) -> int:
        """Drop the lease's references; returns how many slots it held."""
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            raise PoolError(ErrorCode.BAD_REQUEST, f"unknown lease {lease_id!r} (released or expired)")
        # tail first: a request's last blocks become the oldest in the LRU, evicted before its first ones
        self.pool.release(lease.slots[::-1])
        return len(lease.slots)

    def expire(self) -> list[Lease]:
        """Release every lease whose deadline has passed (their holders crashed or forgot)."""
        now = self.clock()
        expired = [lease for lease in self.leases.values() if lease.deadline <= now]
        for lease in expired:
            self.release(lease.lease_id)
            log.warning("kvstore: lease %s expired holding %d blocks", lease.lease_id, len(lease.slots))
        return expired

    def take_events(self) -> list[BlockStored | BlockEvicted]:
        """Index events for the Valkey routing hints (the routing index reads its own queue)."""
        return self.pool.take_events(self._hints)

    def indexed_keys(self) -> list[bytes]:
        return [key for key in self.pool.block_key if key is not None]

    def check_invariants(self) -> None:
        """The pool's own invariants, and: every reference belongs to exactly one lease entry."""
        self.pool.check_invariants()
        refs = [0] * self.num_slots
        for lease in self.leases.values():
            assert lease.owned <= set(lease.slots), f"lease {lease.lease_id} owns a slot it does not hold"
            for slot in lease.slots:
                refs[slot] += 1
        assert refs == self.pool.ref_counts, "pool references and lease holdings disagree"

    # ---------------------------------------------------------------------------------- internals

    def _new_lease(self, ttl_s: float) -> Lease:
        lease = Lease(secrets.token_hex(8), self.clock() + ttl_s)
        self.leases[lease.lease_id] = lease
        return lease

    def _check_ttl(self, ttl_s: float) -> None:
        if not (math.isfinite(ttl_s) and 0 < ttl_s <= self.max_lease_ttl_s):
            raise PoolError(ErrorCode.BAD_REQUEST, f"lease TTL must be in (0, {self.max_lease_ttl_s:g}] s, got {ttl_s}")
