"""The kvstore service: a block pool behind NATS request/reply on pd.kv.<store>.<op>.

    receive (one subscription per op) → decode into the op's type → pool / memory → reply

    op        request          reply
    info      (empty)          KVStoreInfo
    lookup    KVLookup         KVLookupReply     longest cached prefix, leased
    allocate  KVAllocate       KVAllocateReply   OVERLOADED when even eviction cannot make room
    write     KVWriteChunk     KVReply           network data path (same-host writers use shm)
    commit    KVCommit         KVReply           checksums; index slots that have keys
    read      KVRead           KVReadChunk × n   streamed to the reply inbox, last=True on the final one
    release   KVRelease        KVReply
    renew     KVRenew          KVReply
    stats     (empty)          WorkerStats

Every request is answered: a malformed one with BAD_REQUEST, a refused one with the pool's code, a
bug with INTERNAL (and a logged traceback). Nothing a client sends can stop the service.
Background tasks: the lease reaper (releases expired leases), stats on NATS, Valkey registry and
routing hints (`heartbeat.py`), and the routing index's events (shared/transport/cache_events.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg as NatsMsg
from nats.aio.subscription import Subscription

from services.kvstore.config import KVStoreConfig
from services.kvstore.heartbeat import Heartbeat
from services.kvstore.pool import PoolError, SlotPool
from services.kvstore.shm import PoolMemory
from shared.protocol import subjects
from shared.transport.cache_events import CachePublisher
from shared.protocol.messages import (
    ErrorCode, KVAllocate, KVAllocateReply, KVCommit, KVLookup, KVLookupReply, KVRead, KVReadChunk, KVRelease,
    KVRenew, KVReply, KVStoreInfo, KVWriteChunk, ResetReply, decode, encode,
)
from shared.transport import nats_bus, valkey

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 5.0  # in-flight reads and the Valkey goodbye get this long on shutdown


@dataclass(frozen=True)
class _Op:
    request: type | None  # None: the body is ignored (info, stats)
    handle: Callable[[Any], msgspec.Struct]
    error: Callable[[ErrorCode, str], msgspec.Struct]  # builds the reply that carries an error


def _reply_error(code: ErrorCode, message: str) -> KVReply:
    return KVReply(error_code=code, error=message)


class KVStoreService:
    def __init__(self, config: KVStoreConfig):
        self.config = config
        self.store = config.store
        self.pool = SlotPool(config.num_slots, max_lease_ttl_s=config.max_lease_ttl_s)
        self.memory: PoolMemory | None = None
        self.nc: NATS | None = None
        self.heartbeat: Heartbeat | None = None
        self.cache_events: CachePublisher | None = None  # the gateways' routing index follows these
        self.ready = asyncio.Event()
        self._stopped = False
        self._subs: list[Subscription] = []
        self._background: list[asyncio.Task] = []
        self._reads: set[asyncio.Task] = set()
        self._leases_changed = asyncio.Event()  # wakes the reaper when a nearer deadline may exist
        self._ops: dict[str, _Op] = {
            "info": _Op(None, lambda _: self.info(), _reply_error),
            "lookup": _Op(KVLookup, self._lookup, lambda c, e: KVLookupReply(error_code=c, error=e)),
            "allocate": _Op(KVAllocate, self._allocate, lambda c, e: KVAllocateReply(error_code=c, error=e)),
            "write": _Op(KVWriteChunk, self._write, _reply_error),
            "commit": _Op(KVCommit, self._commit, _reply_error),
            "release": _Op(KVRelease, self._release, _reply_error),
            "renew": _Op(KVRenew, self._renew, _reply_error),
            "stats": _Op(None, lambda _: self.heartbeat.stats(), _reply_error),
        }

    # ---------------------------------------------------------------------------------- lifecycle

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until `stop` is set. A stop while still starting (NATS not reachable yet: the
        connection retries forever) abandons the start."""
        starting = asyncio.create_task(self.start())
        stopping = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if starting.done():
                starting.result()  # a failed start raises here
                await stopping
            else:
                log.info("kvstore %s: stopped before it finished starting", self.store)
                # cancelled again until it ends: on Python 3.11 a cancel can be lost in nats-py's
                # connect, whose asyncio.wait_for returns the refused connection's OSError instead
                # when both land together (cpython gh-86296), and the connect then retries forever
                # (a stop under load hung here, 2026-12-07)
                while not starting.done():
                    starting.cancel()
                    await asyncio.wait({starting}, timeout=0.5)
        finally:
            starting.cancel()
            stopping.cancel()
            await self.stop()  # tears down whatever was set up, also after a failed start

    async def start(self) -> None:
        cfg = self.config
        self.memory = PoolMemory(cfg.num_slots, cfg.block_bytes, shared=cfg.shared_memory)
        self.nc = await nats_bus.connect(cfg.nats_url, f"kvstore-{self.store}", user=cfg.nats_user,
                                         password=cfg.nats_password, token=cfg.nats_token)
        self.heartbeat = Heartbeat(cfg, self.pool, self.nc, valkey.connect(cfg.redis_url, cfg.redis_password))
        index_queue = self.pool.pool.add_event_queue()

        async def keys() -> list[bytes]:
            return self.pool.pool.cached_keys()

        self.cache_events = CachePublisher(self.nc, self.heartbeat.redis, subjects.cache_location("store", self.store),
                                           lambda: self.pool.pool.take_events(index_queue), keys)
        await self.cache_events.start()
        self._index_stop = asyncio.Event()
        for op in subjects.KV_OPS:
            handler = self._on_read if op == "read" else self._make_handler(op)
            self._subs.append(await self.nc.subscribe(subjects.kv(self.store, op), cb=handler))
        self._subs.append(await self.nc.subscribe(subjects.RESET_PREFIX_CACHE, cb=self._on_reset))
        await nats_bus.settle(self.nc)  # subscriptions are live on the server before we say we are ready
        self._background = [asyncio.create_task(coro, name=f"kvstore-{name}") for name, coro in (
            ("reaper", self._reap_leases()), ("stats", self.heartbeat.run_nats()),
            ("valkey", self.heartbeat.run_valkey()), ("index", self.cache_events.run(self._index_stop)))]
        log.info("kvstore %s: %d slots × %d bytes (%.0f MiB, %s), layout %s, on %s", self.store, cfg.num_slots,
                 cfg.block_bytes, cfg.pool_bytes / 2**20, f"shm {self.memory.name}" if self.memory.name else
                 "private memory", cfg.layout, cfg.nats_url)
        self.ready.set()

    async def stop(self) -> None:
        """Stop taking requests, finish in-flight reads, leave Valkey, drain NATS, unlink the pool."""
        if self._stopped:
            return
        self._stopped = True
        log.info("kvstore %s: shutting down", self.store)
        for sub in self._subs:
            try:
                await sub.drain()  # answer what is already queued, take nothing new
            except Exception as exc:  # connection already closed: nothing left to stop
                log.debug("kvstore: draining a subscription failed: %s", exc)
        self._subs.clear()
        if self._reads:
            _, stuck = await asyncio.wait(self._reads, timeout=SHUTDOWN_GRACE_S)
            for task in stuck:
                task.cancel()
            await asyncio.gather(*stuck, return_exceptions=True)
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        self._background.clear()
        if self.heartbeat is not None:
            # leave the registry, the hints and the routing index at once, within one grace period
            goodbyes = [self.heartbeat.withdraw()] + ([self.cache_events.withdraw()] if self.cache_events else [])
            try:
                await asyncio.wait_for(asyncio.gather(*goodbyes), SHUTDOWN_GRACE_S)
            except Exception as exc:
                log.warning("kvstore %s: could not withdraw from Valkey: %s", self.store, exc)
            await self.heartbeat.redis.aclose()
        if self.nc is not None and not self.nc.is_closed:
            try:
                await self.nc.drain()
            except Exception as exc:
                log.warning("kvstore %s: NATS drain failed: %s", self.store, exc)
                await self.nc.close()
        if self.memory is not None:
            self.memory.close()
        self.ready.clear()

    # --------------------------------------------------------------------------------- operations

    def info(self) -> KVStoreInfo:
        return KVStoreInfo(store=self.store, shm_name=self.memory.name, num_slots=self.config.num_slots,
                           block_bytes=self.config.block_bytes, block_size=self.config.block_size,
                           layout=self.config.layout, max_payload=self.nc.max_payload)

    def _lookup(self, req: KVLookup) -> KVLookupReply:
        lease_id, blocks = self.pool.lookup(req.keys, req.lease_ttl_s)
        self._leases_changed.set()
        return KVLookupReply(lease_id=lease_id, blocks=blocks, segment=self.memory.name)

    def _allocate(self, req: KVAllocate) -> KVAllocateReply:
        lease_id, slots = self.pool.allocate(req.num_blocks, req.lease_ttl_s, req.lease_id)
        self._leases_changed.set()
        return KVAllocateReply(lease_id=lease_id, slots=slots, segment=self.memory.name)

    def _write(self, req: KVWriteChunk) -> KVReply:
        self.pool.check_writable(req.lease_id, req.slot)
        if not (0 <= req.offset and req.offset + len(req.data) <= self.config.block_bytes):
            raise PoolError(ErrorCode.BAD_REQUEST, f"write of {len(req.data)} bytes at offset {req.offset} "
                                                   f"overruns a {self.config.block_bytes}-byte block")
        self.memory.view(req.slot, req.offset, len(req.data))[:] = req.data
        return KVReply()

    def _commit(self, req: KVCommit) -> KVReply:
        self.pool.commit(req.lease_id, req.slots, req.keys, req.checksums)
        return KVReply()

    def _release(self, req: KVRelease) -> KVReply:
        self.pool.release(req.lease_id)
        return KVReply()

    def _renew(self, req: KVRenew) -> KVReply:
        self.pool.renew(req.lease_id, req.lease_ttl_s)
        self._leases_changed.set()  # a renewal may also shorten a lease
        return KVReply()

    # -------------------------------------------------------------------------------- NATS plumbing

    def _make_handler(self, name: str) -> Callable[[NatsMsg], Any]:
        op = self._ops[name]

        async def handle(msg: NatsMsg) -> None:
            try:
                request = decode(msg.data, op.request) if op.request is not None else None
                reply = op.handle(request)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning("kvstore %s: malformed %s request (%d bytes): %s", self.store, name, len(msg.data), exc)
                reply = op.error(ErrorCode.BAD_REQUEST, f"malformed {name} request: {exc}")
            except PoolError as exc:
                reply = op.error(exc.code, str(exc))
            except Exception as exc:
                log.exception("kvstore %s: %s failed", self.store, name)
                reply = op.error(ErrorCode.INTERNAL, f"kvstore {self.store}: {name} failed: {exc!r}")
            await self._respond(msg, name, encode(reply))

        return handle

    async def _on_reset(self, msg: NatsMsg) -> None:
        blocks = self.pool.pool.reset_prefix_cache()
        log.info("kvstore %s: prefix cache reset (%d blocks forgotten)", self.store, blocks)
        await self._respond(msg, "reset", encode(ResetReply(role="kvstore", instance=self.store, blocks=blocks)))

    async def _respond(self, msg: NatsMsg, name: str, data: bytes) -> None:
        if not msg.reply:
            log.warning("kvstore %s: %s request without a reply subject, dropped", self.store, name)
            return
        try:
            await self.nc.publish(msg.reply, data)
        except Exception as exc:  # connection trouble: the client times out and retries
            log.warning("kvstore %s: cannot answer %s: %s", self.store, name, exc)

    async def _respond_read_error(self, msg: NatsMsg, code: ErrorCode, message: str) -> None:
        chunk = KVReadChunk(slot=-1, offset=0, data=b"", last=True, error_code=code, error=message)
        await self._respond(msg, "read", encode(chunk))

    async def _on_read(self, msg: NatsMsg) -> None:
        # Each read streams on its own task, so one long read does not hold up the next.
        task = asyncio.create_task(self._stream_read(msg))
        self._reads.add(task)
        task.add_done_callback(self._reads.discard)

    async def _stream_read(self, msg: NatsMsg) -> None:
        """Publish the slots' bytes to the reply inbox in chunks below max_payload:

            slot a: [0, c) [c, 2c) … [k·c, block_bytes)   slot b: …   the very last chunk has last=True
        """
        try:
            req = decode(msg.data, KVRead)
            self.pool.check_readable(req.lease_id, req.slots)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("kvstore %s: malformed read request (%d bytes): %s", self.store, len(msg.data), exc)
            return await self._respond_read_error(msg, ErrorCode.BAD_REQUEST, f"malformed read request: {exc}")
        except PoolError as exc:
            return await self._respond_read_error(msg, exc.code, str(exc))
        except Exception as exc:
            log.exception("kvstore %s: read failed", self.store)
            return await self._respond_read_error(msg, ErrorCode.INTERNAL, f"read failed: {exc!r}")
        if not req.slots or not msg.reply:
            await self._respond(msg, "read", encode(KVReadChunk(slot=-1, offset=0, data=b"", last=True)))
            return
        block_bytes = self.config.block_bytes
        max_payload = self.nc.max_payload
        chunk = max(max_payload - self.config.read_chunk_headroom, max_payload // 2)
        try:
            for i, slot in enumerate(req.slots):
                for offset in range(0, block_bytes, chunk):
                    n = min(chunk, block_bytes - offset)
                    last = i == len(req.slots) - 1 and offset + n == block_bytes
                    # the memoryview is encoded straight from the pool: one copy into the message
                    data = encode(KVReadChunk(slot=slot, offset=offset, data=self.memory.view(slot, offset, n),
                                              last=last))
                    await self.nc.publish(msg.reply, data)
                    # let nats-py's flusher write this chunk now. Queued all at once, a read's chunks
                    # go out as one write of the whole read (tens of MB): asyncio (3.11) buffers what
                    # the socket does not take and moves the rest down after every send, which cost
                    # a third of a 17 MB read's time (59 ms against 40 with this)
                    await asyncio.sleep(0)
        except Exception as exc:
            log.warning("kvstore %s: read of %d slots broke off: %s", self.store, len(req.slots), exc)

    async def _reap_leases(self) -> None:
        """Release leases whose deadline passed; sleeps until the nearest deadline (or a change)."""
        while True:
            self._leases_changed.clear()
            deadline = self.pool.next_deadline()
            timeout = 1.0 if deadline is None else min(1.0, deadline - self.pool.clock() + 0.001)
            if timeout > 0:
                with contextlib.suppress(TimeoutError):  # the timeout is the normal wake-up: a deadline is due
                    await asyncio.wait_for(self._leases_changed.wait(), timeout)
            try:
                self.pool.expire()
            except Exception:
                log.exception("kvstore %s: releasing expired leases failed", self.store)


async def run_kvstore(config: KVStoreConfig, stop_event: asyncio.Event) -> None:
    """Run a store until `stop_event` is set (in-process use: tests, `pdserve up`)."""
    await KVStoreService(config).run(stop_event)
