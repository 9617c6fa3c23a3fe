"""Faulting memory in before a request needs it.

The KV memory of a CPU host is mapped lazily: the engine's cache is an anonymous mapping whose pages
the kernel provides on first touch, and a worker's mapping of the kvstore's shared-memory segment
gets its page-table entries one fault at a time. A prompt's blocks written into memory never touched
paid those faults on the request path: 48 blocks (a 768-token prompt, 4,320 pages) into fresh slots
of the store's segment took 7.5-10 ms against 2.5 ms once mapped. `populate` asks the kernel for a
range's pages in one call (`madvise(MADV_POPULATE_WRITE)`, Linux 5.14+), which neither changes a
byte nor holds the GIL (ctypes releases it), so it can run beside the code that uses the memory.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import sys
import threading

log = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # <linux/mman.h>, since 5.14
PAGE = mmap.PAGESIZE

_madvise = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _madvise = _libc.madvise
        _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _madvise.restype = ctypes.c_int
    except (OSError, AttributeError):
        _madvise = None


def populate(address: int, length: int) -> bool:
    """Fault in the pages of [address, address + length) for writing, as a write would, without
    writing: pages already there are left alone, missing ones are allocated (zero for anonymous
    memory, the file's for a shared one). The range is widened to whole pages. Returns False where
    the kernel cannot (not Linux, older than 5.14, or out of memory: the writes then fault as before)."""
    if _madvise is None or length <= 0:
        return False
    start = address - address % PAGE
    end = address + length
    if _madvise(start, end - start, MADV_POPULATE_WRITE) != 0:
        log.debug("madvise(MADV_POPULATE_WRITE) failed: %s", ctypes.get_errno())
        return False
    return True


class WarmAhead:
    """Keeps the blocks just past the highest one an allocator has handed out faulted in, from a
    background thread, so that a block is resident before its first write without the whole
    region becoming resident at start.

    The block pools (`BlockPool`, the kvstore's slots) hand out block 0, 1, 2, … in order and take
    freed ones back first, so "the highest block handed out" (`BlockPool.high_water`) is where new
    memory is first touched. `need(high_water)` is cheap and may be called after every allocation;
    it asks for [0, high_water + ahead) and wakes the thread if that is more than it has faulted in.
    """

    def __init__(self, address: int, block_bytes: int, num_blocks: int, ahead: int, name: str = "kv-warm-ahead"):
        self.address, self.block_bytes, self.num_blocks = address, block_bytes, num_blocks
        self.ahead = max(0, min(ahead, num_blocks))
        self.done = 0  # blocks [0, done) are faulted in
        self._target = 0
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self.need(0)

    def need(self, high_water: int) -> None:
        target = min(self.num_blocks, high_water + self.ahead)
        if target > self._target:
            with self._cond:
                self._target = max(self._target, target)
                self._cond.notify()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until everything asked for so far is faulted in (tests, benchmarks)."""
        with self._cond:
            return self._cond.wait_for(lambda: self.done >= self._target or self._closed, timeout)

    def close(self) -> None:
        """Stop the thread, after the call it is in, if any (never waited for: on memory unmapped
        meanwhile that call fails harmlessly, and populating pages changes none of their bytes)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _run(self) -> None:
        step = max(1, (4 << 20) // max(1, self.block_bytes))  # ~4 MiB a call: close() is never kept waiting long
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._target > self.done or self._closed)
                if self._closed:
                    return
                start, end = self.done, min(self._target, self.done + step)
            ok = populate(self.address + start * self.block_bytes, (end - start) * self.block_bytes)
            with self._cond:
                if not ok:  # no such madvise here, or no memory: the writes fault as they always did
                    self._closed = True
                    self._cond.notify_all()
                    return
                self.done = end
                self._cond.notify_all()
