"""Client of a kvstore (`services/kvstore`), used by prefill and decode workers.

Control plane: NATS request/reply on pd.kv.<store>.<op>. Data plane, picked at `attach()`:

    same host   the store's shared-memory segment, mapped here: a block write or read is one memcpy
                (consecutive slots: one memcpy for the run), no bytes on the wire
    otherwise   KVWriteChunk requests / a KVRead streamed back as KVReadChunks, each below NATS
                max_payload

A store that restarts comes back with a new segment (and none of the old leases). Replies that hand
out slots (lookup, allocate) and DecodeJobs name the segment their slots belong to; the client
re-attaches when that is not the segment it maps, and refuses to touch slots of a segment that is
gone, so a stale lease or slot reference is never read or written.

Both paths checksum every block (`checksum`, XXH3-64): the writer computes it and commits it with
the block, the reader verifies it after copying, so a torn, evicted-and-rewritten or corrupted block
raises `KVChecksumError` instead of silently becoming wrong KV. Copies and checksums of large
transfers run on a worker thread (memcpy and xxhash release the GIL), keeping the event loop
responsive.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import sys

import msgspec
import nats.errors
import numpy as np
import torch
import xxhash
from nats.aio.client import Client as NATS

from shared.kvcache.pages import WarmAhead
from shared.protocol import subjects
from shared.protocol.messages import (
    ErrorCode, KVAllocate, KVAllocateReply, KVBlockRef, KVCommit, KVLookup, KVLookupReply, KVRead, KVReadChunk,
    KVRelease, KVRenew, KVReply, KVStoreInfo, KVWriteChunk, decode, encode,
)

log = logging.getLogger(__name__)

CHUNK_HEADROOM = 64 * 1024  # bytes kept free under max_payload for the message envelope
WRITE_WINDOW = 8  # network write chunks in flight at once
READ_BATCH_BYTES = 32 * 2**20  # one KVRead streams at most this much (bounds buffering on both ends)
OFFLOAD_BYTES = 4 * 2**20  # shm copies + checksums at least this big run on a worker thread
WARM_AHEAD_BYTES = 32 * 2**20  # the segment mapped ahead of the highest slot seen (shared/kvcache/pages.py)


class KVStoreError(RuntimeError):
    """A kvstore operation failed; `code` says how (the store's error code, TIMEOUT, INTERNAL…)."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code = ErrorCode(code)


class KVChecksumError(KVStoreError):
    """A block's bytes do not match the checksum it was committed with."""

    def __init__(self, slot: int, expected: int, actual: int):
        super().__init__(ErrorCode.KV_TRANSFER_FAILED,
                         f"KV block in slot {slot} is corrupt: checksum {actual:#018x}, committed {expected:#018x}")
        self.slot = slot


class KVStoreClient:
    def __init__(self, nc: NATS, store: str, *, use_shm: bool = True, timeout: float = 5.0):
        self.nc, self.store, self.use_shm, self.timeout = nc, store, use_shm, timeout
        self.info: KVStoreInfo | None = None
        self._segment: _Segment | None = None
        self._pool: np.ndarray | None = None  # [num_slots, block_bytes] uint8 over the mapped segment
        self._warm: WarmAhead | None = None  # … whose page-table entries are made ahead of use
        self._attaching = asyncio.Lock()  # one re-attach at a time (several requests notice a restart at once)

    @property
    def shm_attached(self) -> bool:
        return self._pool is not None

    # ------------------------------------------------------------------------------- control plane

    async def attach(self, expected_layout: str | None = None) -> KVStoreInfo:
        """Ask the store what it is; map its shared memory if it is on this host (and use_shm)."""
        info = await self._request("info", b"", KVStoreInfo)
        if expected_layout is not None and info.layout != expected_layout:
            raise KVStoreError(ErrorCode.BAD_REQUEST, f"kvstore {self.store!r} holds blocks of layout {info.layout!r}, "
                                                      f"this worker's model needs {expected_layout!r}")
        self._close_segment()
        if self.use_shm and info.shm_name:
            size = info.num_slots * info.block_bytes
            try:
                self._segment = _Segment(info.shm_name, size)
            except (FileNotFoundError, ValueError, ImportError) as exc:  # another host (or no POSIX shm)
                log.info("kvstore %s: shared memory %s not mappable here (%s); using the network path",
                         self.store, info.shm_name, exc)
            else:
                self._pool = np.frombuffer(self._segment.buf, dtype=np.uint8).reshape(info.num_slots,
                                                                                      info.block_bytes)
                # The store hands out slots 0, 1, 2, … first. Each page of the segment written or read
                # here for the first time faulted on the request path (48 blocks: 5 ms of 7.5).
                self._warm = WarmAhead(self._pool.ctypes.data, info.block_bytes, info.num_slots,
                                       max(1, WARM_AHEAD_BYTES // info.block_bytes), f"kv-segment-warm-{self.store}")
        self.info = info
        return info

    async def lookup(self, keys: list[bytes], lease_ttl_s: float = 30.0) -> KVLookupReply:
        """Lease the longest cached prefix of `keys` (lease_id "" and no blocks on a miss)."""
        reply = await self._request("lookup", KVLookup(keys=keys, lease_ttl_s=lease_ttl_s), KVLookupReply)
        if reply.blocks:
            await self.ensure_segment(reply.segment)
        return reply

    async def allocate(self, n: int, lease_id: str = "", lease_ttl_s: float = 30.0) -> KVAllocateReply:
        """n writable slots in a new lease, or added to `lease_id`. Raises KVStoreError (OVERLOADED
        when the store is full of leased blocks)."""
        reply = await self._request("allocate", KVAllocate(num_blocks=n, lease_ttl_s=lease_ttl_s, lease_id=lease_id),
                                    KVAllocateReply)
        await self.ensure_segment(reply.segment)
        self._warm_past(reply.slots)
        return reply

    async def ensure_segment(self, segment: str) -> None:
        """Make sure slots of `segment` are what this client reads and writes: re-attach if the
        store has restarted since (a new segment); raise KVStoreError if `segment` is gone."""
        if not segment or (self.info is not None and self.info.shm_name == segment):
            return
        async with self._attaching:
            if self.info is not None and self.info.shm_name == segment:
                return  # another request re-attached meanwhile
            old = self.info.shm_name if self.info is not None else "(none)"
            info = await self.attach(self.info.layout if self.info is not None else None)
            if info.shm_name != segment:
                raise KVStoreError(ErrorCode.KV_TRANSFER_FAILED,
                                   f"kvstore {self.store!r}: blocks of segment {segment} are gone (the store "
                                   f"restarted; it now has segment {info.shm_name})")
            log.warning("kvstore %s restarted: re-attached to its new segment %s (was %s)", self.store,
                        info.shm_name, old)

    async def commit(self, lease_id: str, slots: list[int], keys: list[bytes], checksums: list[int]) -> None:
        await self._request("commit", KVCommit(lease_id=lease_id, slots=slots, keys=keys, checksums=checksums), KVReply)

    async def release(self, lease_id: str) -> None:
        await self._request("release", KVRelease(lease_id=lease_id), KVReply)

    async def renew(self, lease_id: str, ttl: float) -> None:
        await self._request("renew", KVRenew(lease_id=lease_id, lease_ttl_s=ttl), KVReply)

    async def close(self) -> None:
        """Unmap the segment (the NATS connection belongs to the caller)."""
        self._close_segment()

    def _close_segment(self) -> None:
        self._pool = None
        if self._warm is not None:
            self._warm.close()
            self._warm = None
        if self._segment is not None:
            segment, self._segment = self._segment, None
            segment.close()

    # ---------------------------------------------------------------------------------- data plane

    async def write_blocks(self, lease_id: str, slots: list[int], data: torch.Tensor, segment: str = "") -> list[int]:
        """Fill `slots` (of `segment`, as allocate named it) with data[i] (each row exactly
        block_bytes bytes, any dtype); returns the checksum of each block, for `commit`."""
        await self.ensure_segment(segment)
        info = self._attached()
        self._check_slots(slots)
        if data.device.type != "cpu":
            data = data.cpu()
        rows = _as_rows(data, len(slots), info.block_bytes)
        if self._pool is not None:
            return await _maybe_offload(rows.numel(), _write_shm, self._pool, slots, rows.numpy())
        return await self._write_network(lease_id, slots, rows.numpy())

    async def read_blocks(self, lease_id: str, blocks: list[KVBlockRef], out: torch.Tensor, segment: str = "") -> None:
        """Fill out[i] (a row of block_bytes bytes) with block i (of `segment`, as the lease named
        it), verifying its checksum. Raises KVChecksumError on a mismatch, KVStoreError on any
        other failure (the segment gone with a restarted store included)."""
        info = self._attached()
        if not blocks:
            return
        await self.ensure_segment(segment)
        info = self._attached()
        slots = [block.slot for block in blocks]
        self._check_slots(slots)
        if len(set(slots)) != len(slots):
            raise ValueError("read_blocks: a slot is listed twice")
        self._warm_past(slots)
        stage = out if out.device.type == "cpu" else torch.empty(out.shape, dtype=out.dtype,
                                                                  pin_memory=torch.cuda.is_available())
        rows = _as_rows(stage, len(blocks), info.block_bytes)
        if self._pool is not None:
            await _maybe_offload(rows.numel(), _read_shm, self._pool, blocks, rows.numpy())
        else:
            await self._read_network(lease_id, blocks, rows.numpy())
        if stage is not out:
            out.copy_(stage)

    async def _write_network(self, lease_id: str, slots: list[int], rows: np.ndarray) -> list[int]:
        """KVWriteChunk requests, WRITE_WINDOW in flight; each chunk is encoded straight from `rows`."""
        info = self.info
        chunk = _chunk_bytes(info.max_payload)
        window = asyncio.Semaphore(WRITE_WINDOW)

        async def send(request: KVWriteChunk) -> None:
            async with window:
                await self._request("write", request, KVReply)

        checksums, tasks = [], []
        try:
            for slot, row in zip(slots, rows):
                block = memoryview(row)
                checksums.append(checksum(block))
                tasks += [asyncio.create_task(send(KVWriteChunk(lease_id=lease_id, slot=slot, offset=offset,
                                                                data=block[offset:offset + chunk])))
                          for offset in range(0, info.block_bytes, chunk)]
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()  # after a failure: stop sending the rest (no-op on finished ones)
        return checksums

    async def _read_network(self, lease_id: str, blocks: list[KVBlockRef], rows: np.ndarray) -> None:
        block_bytes = self.info.block_bytes
        per_read = max(1, READ_BATCH_BYTES // block_bytes)
        for start in range(0, len(blocks), per_read):
            batch = blocks[start:start + per_read]
            await self._read_stream(lease_id, batch, rows[start:start + per_read])
            for block, row in zip(batch, rows[start:start + per_read]):
                _verify(block, row)

    async def _read_stream(self, lease_id: str, blocks: list[KVBlockRef], rows: np.ndarray) -> None:
        """One KVRead: the store streams KVReadChunks to a fresh inbox, the last with last=True."""
        block_bytes = self.info.block_bytes
        row_of = {block.slot: i for i, block in enumerate(blocks)}
        received = [0] * len(blocks)
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox)
        try:
            await self.nc.publish(subjects.kv(self.store, "read"),
                                  encode(KVRead(lease_id=lease_id, slots=[b.slot for b in blocks])), reply=inbox)
            while True:
                try:
                    msg = await sub.next_msg(timeout=self.timeout)
                except nats.errors.TimeoutError:
                    raise KVStoreError(ErrorCode.TIMEOUT, f"kvstore {self.store!r}: read stalled, nothing for "
                                                          f"{self.timeout:g} s") from None
                try:
                    chunk = decode(msg.data, KVReadChunk)
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    raise KVStoreError(ErrorCode.INTERNAL, f"kvstore {self.store!r}: bad read chunk: {exc}") from exc
                if chunk.error_code != ErrorCode.OK:
                    raise KVStoreError(chunk.error_code, f"kvstore {self.store!r}: read: {chunk.error}")
                if chunk.data:
                    i = row_of.get(chunk.slot)
                    end = chunk.offset + len(chunk.data)
                    if i is None or chunk.offset < 0 or end > block_bytes:
                        raise KVStoreError(ErrorCode.INTERNAL, f"kvstore {self.store!r}: unasked-for read chunk: "
                                                               f"slot {chunk.slot} [{chunk.offset}, {end})")
                    rows[i, chunk.offset:end] = np.frombuffer(chunk.data, dtype=np.uint8)
                    received[i] += len(chunk.data)
                if chunk.last:
                    break
        finally:
            await sub.unsubscribe()
        short = [b.slot for b, got in zip(blocks, received) if got != block_bytes]
        if short:
            raise KVStoreError(ErrorCode.KV_TRANSFER_FAILED, f"kvstore {self.store!r}: read ended without all "
                                                             f"bytes of slots {short}")

    # ----------------------------------------------------------------------------------- plumbing

    async def _request(self, op: str, request: msgspec.Struct | bytes, reply_type: type):
        """One request/reply; every failure becomes a KVStoreError naming the store and the op."""
        subject = subjects.kv(self.store, op)
        payload = request if isinstance(request, bytes) else encode(request)
        try:
            msg = await self.nc.request(subject, payload, timeout=self.timeout)
        except nats.errors.NoRespondersError:
            raise KVStoreError(ErrorCode.INTERNAL, f"kvstore {self.store!r}: nobody answers {op} on {subject} "
                                                   "(store not running?)") from None
        except (nats.errors.TimeoutError, asyncio.TimeoutError):
            raise KVStoreError(ErrorCode.TIMEOUT, f"kvstore {self.store!r}: {op} timed out after "
                                                  f"{self.timeout:g} s") from None
        except nats.errors.Error as exc:
            raise KVStoreError(ErrorCode.INTERNAL, f"kvstore {self.store!r}: {op} failed: {exc!r}") from exc
        try:
            reply = decode(msg.data, reply_type)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            # a store that cannot build the typed reply (info) answers with a plain KVReply error
            error = _try_decode(msg.data, KVReply)
            if error is not None and error.error_code != ErrorCode.OK:
                raise KVStoreError(error.error_code, f"kvstore {self.store!r}: {op}: {error.error}") from None
            raise KVStoreError(ErrorCode.INTERNAL, f"kvstore {self.store!r}: bad {op} reply: {exc}") from exc
        code = getattr(reply, "error_code", ErrorCode.OK)
        if code != ErrorCode.OK:
            raise KVStoreError(code, f"kvstore {self.store!r}: {op}: {reply.error}")
        return reply

    def _attached(self) -> KVStoreInfo:
        if self.info is None:
            raise RuntimeError(f"KVStoreClient({self.store!r}): call attach() first")
        return self.info

    def _warm_past(self, slots: list[int]) -> None:
        if self._warm is not None and slots:
            self._warm.need(max(slots) + 1)

    def _check_slots(self, slots: list[int]) -> None:
        num_slots = self.info.num_slots
        for slot in slots:
            if not 0 <= slot < num_slots:
                raise ValueError(f"slot {slot} is outside kvstore {self.store!r}'s pool of {num_slots}")


# ------------------------------------------------------------------------------------ copy helpers


def _as_rows(t: torch.Tensor, n: int, block_bytes: int) -> torch.Tensor:
    """[n, …] tensor of any dtype → [n, block_bytes] uint8 view of the same memory (never a copy)."""
    t = t.detach()
    if t.dim() == 0 or t.shape[0] != n:
        raise ValueError(f"expected {n} blocks along dim 0, got a tensor of shape {tuple(t.shape)}")
    try:
        rows = (t if t.dtype == torch.uint8 else t.view(torch.uint8)).view(n, -1)
    except RuntimeError as exc:
        raise ValueError(f"each block must be one contiguous row; got shape {tuple(t.shape)} strides "
                         f"{t.stride()}: {exc}") from exc
    if rows.shape[1] != block_bytes:
        raise ValueError(f"each block must be {block_bytes} bytes, got {rows.shape[1]} "
                         f"(shape {tuple(t.shape)}, {t.dtype})")
    return rows


def checksum(block) -> int:
    """A block's checksum: XXH3-64 of its bytes (a 64-bit unsigned int). crc32 ran at 3-5 GB/s and,
    paid by the writer and again by the reader, was half a shared-memory transfer's time (48 blocks:
    5.7 ms to write, of which 3.6 ms crc32); XXH3 runs at ~25 GB/s."""
    return xxhash.xxh3_64_intdigest(block)


# Copies go through numpy: one single-threaded memcpy a block. torch's copy_ splits a big copy
# across its intra-op threads, which on a small, busy host (2 cores, the other one computing) was
# 4× slower than one memcpy (8 ms vs 1.9 ms for 44 MiB). Each block is checksummed right after its
# copy, while its 360 KiB are still in cache: over the copy, so what was checked is what was
# stored (write) or handed to the caller (read).

def _write_shm(pool: np.ndarray, slots: list[int], rows: np.ndarray) -> list[int]:
    checksums = []
    for slot, row in zip(slots, rows):
        np.copyto(pool[slot], row)
        checksums.append(checksum(memoryview(pool[slot])))
    return checksums


def _read_shm(pool: np.ndarray, blocks: list[KVBlockRef], rows: np.ndarray) -> None:
    for block, row in zip(blocks, rows):
        np.copyto(row, pool[block.slot])
        _verify(block, row)


def _verify(block: KVBlockRef, row: np.ndarray) -> None:
    actual = checksum(memoryview(row))
    if actual != block.checksum:
        raise KVChecksumError(block.slot, block.checksum, actual)


async def _maybe_offload(nbytes: int, fn, *args):
    if nbytes >= OFFLOAD_BYTES:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


def _chunk_bytes(max_payload: int) -> int:
    return max(max_payload - CHUNK_HEADROOM, max_payload // 2)


def _try_decode(data: bytes, type_: type):
    try:
        return decode(data, type_)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


# ---------------------------------------------------------------------------------- shared memory


class _Segment:
    """The store's POSIX shared-memory segment, mapped read-write in this process.

    Not `multiprocessing.shared_memory.SharedMemory(name)`: before Python 3.13 attaching registers
    the segment with this process's resource tracker, which unlinks it — the store's segment! —
    when this process exits. Unregistering afterwards would also drop the store's own registration
    when both live in one process (tests, `pdserve up`). So open and map it directly.
    """

    def __init__(self, name: str, size: int):
        if sys.version_info >= (3, 13):
            from multiprocessing.shared_memory import SharedMemory

            self._shm = SharedMemory(name=name, track=False)
            self._mmap = None
            mapped = self._shm.buf
        else:
            import _posixshmem  # CPython's POSIX shm binding (what SharedMemory itself uses)

            self._shm = None
            fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
            try:
                self._mmap = mmap.mmap(fd, os.fstat(fd).st_size)
            finally:
                os.close(fd)  # the mapping keeps its own reference
            mapped = memoryview(self._mmap)
        self.buf, self._whole = None, mapped
        if len(mapped) < size:
            self.close()
            raise ValueError(f"segment {name} holds {len(mapped)} bytes, the store announced {size}")
        self.buf = mapped[:size]
        self._whole = mapped

    def close(self) -> None:
        """Unmap now if nothing else uses the mapping; otherwise (a caller's array, or a worker thread
        that has not yet dropped its arguments) it is unmapped when the last user lets go."""
        views, self.buf, self._whole = (self.buf, self._whole), None, None
        mapping = self._mmap if self._mmap is not None else self._shm
        self._mmap = self._shm = None
        try:
            for view in views:
                if view is not None:
                    view.release()
            if mapping is not None:
                mapping.close()
        except BufferError as exc:
            log.debug("kvstore segment still in use at close (%s); unmapped when released", exc)
