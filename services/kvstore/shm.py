"""The store's block memory: `num_slots × block_bytes` bytes, slot s at byte offset s × block_bytes.

    segment:  | slot 0 | slot 1 | slot 2 | … | slot n-1 |      each block_bytes long
    `slots`:  the same bytes as a uint8 array [num_slots, block_bytes] (no copy)

On a CPU host the bytes live in a POSIX shared-memory segment that same-host workers map (see
`shared.transport.kv_client`), so a block read or write is one memcpy. The store creates the
segment under a unique name, registers it with this process's resource tracker (which unlinks it
if the store dies without cleaning up) and unlinks it on shutdown.
"""

from __future__ import annotations

import logging
import os
import secrets
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)


class PoolMemory:
    def __init__(self, num_slots: int, block_bytes: int, *, shared: bool = True):
        self.num_slots, self.block_bytes = num_slots, block_bytes
        size = num_slots * block_bytes
        self._shm: shared_memory.SharedMemory | None = None
        if Path("/proc/driver/nvidia/version").exists():  # an NVIDIA driver: a CUDA host
            # DESIGN.md: on CUDA hosts the pool is pinned (page-locked) host memory so device copies are
            # DMA; pinning the shm pages (cudaHostRegister) would keep same-host mapping too. Not built
            # yet: the shared-memory segment below is what runs, and device copies go through pageable
            # memory.
            log.warning("kvstore: CUDA is available but the pinned-memory pool is not implemented; "
                        "using a pageable shared-memory segment")
        if shared:
            self._shm = shared_memory.SharedMemory(name=f"pdkv_{secrets.token_hex(8)}", create=True, size=size)
            self._reserve(size)
            self.name = self._shm.name
            buf = self._shm.buf
        else:
            self.name = ""  # network data path only
            buf = bytearray(size)
        # [num_slots, block_bytes] uint8 over the same bytes; the memoryview is sliced to `size`
        # because the OS may round the segment up to a page multiple.
        self.buf = memoryview(buf)[:size]
        self.slots = np.frombuffer(self.buf, dtype=np.uint8).reshape(num_slots, block_bytes)

    def _reserve(self, size: int) -> None:
        """Back the whole segment now. tmpfs grants a sparse segment bigger than /dev/shm (64 MiB in a
        default Docker container) and then kills the process with SIGBUS on first touch; allocating
        up front turns that into a clear error at start-up."""
        fd = getattr(self._shm, "_fd", -1)
        if fd < 0 or not hasattr(os, "posix_fallocate"):
            return
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            self.close()
            raise MemoryError(
                f"kvstore: cannot back a {size / 2**20:.0f} MiB shared-memory pool ({exc.strerror}); "
                "lower --num-slots or enlarge /dev/shm (Docker: shm_size)"
            ) from exc

    def view(self, slot: int, offset: int = 0, length: int | None = None) -> memoryview:
        """Bytes [offset, offset+length) of a slot, without copying."""
        start = slot * self.block_bytes + offset
        end = (slot + 1) * self.block_bytes if length is None else start + length
        return self.buf[start:end]

    def close(self) -> None:
        """Unmap and unlink the segment (workers that still map it keep their mapping until they let go)."""
        if self._shm is not None:
            shm, self._shm = self._shm, None
            shm.unlink()  # the name goes first: nothing new can attach, whatever happens below
            log.info("kvstore: unlinked shared-memory segment %s", self.name)
        else:
            shm = None
        if hasattr(self, "slots"):
            del self.slots
        try:
            if hasattr(self, "buf"):
                self.buf.release()
                del self.buf
            if shm is not None:
                shm.close()
        except BufferError as exc:  # a view still in use somewhere: the mapping goes when it does
            log.warning("kvstore: pool memory still referenced at close (%s); leaving it mapped", exc)
