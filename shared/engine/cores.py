"""Engines on one host lend each other their cores while idle.

`pdserve up` gives each engine worker a share of the host's cores (its `--threads`). With a fixed
split, a decode worker under chat load runs on half the machine while the prefill worker beside it
waits for the next prompt. Here every worker publishes, in a small shared file, whether it is
stepping; before each step a worker runs with its own share plus the shares of the workers that
are idle right now:

    slot i:  [state, share]     state 0 = unused, 1 = idle, 2 = busy;  share = its own threads

A worker that turns busy takes back its share at its next step; the one that borrowed it gives it
back at *its* next step, so the machine is oversubscribed for at most one step of the borrower.
A worker that dies while busy leaves its slot busy: nobody borrows its cores (the safe side) until
it restarts in the same slot.
"""

from __future__ import annotations

import logging
import mmap
import os
from pathlib import Path

log = logging.getLogger(__name__)

SLOTS = 64
UNUSED, IDLE, BUSY = 0, 1, 2


class CoreShare:
    def __init__(self, path: str | Path, slot: int, share: int):
        if not 0 <= slot < SLOTS:
            raise ValueError(f"core-share slot must be in [0, {SLOTS}), got {slot}")
        if not 1 <= share <= 255:
            raise ValueError(f"core share must be in [1, 255] threads, got {share}")
        self.slot, self.share = slot, share
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < 2 * SLOTS:
                os.ftruncate(fd, 2 * SLOTS)
            self._map = mmap.mmap(fd, 2 * SLOTS)
        finally:
            os.close(fd)
        self._map[2 * slot + 1] = share
        self._state = -1
        self.set_busy(False)

    def set_busy(self, busy: bool) -> None:
        state = BUSY if busy else IDLE
        if state != self._state:
            self._map[2 * self.slot] = state
            self._state = state

    def threads(self) -> int:
        """Threads for the next step: this worker's share plus the shares of the idle others."""
        m = self._map
        n = self.share
        for i in range(SLOTS):
            if i != self.slot and m[2 * i] == IDLE:
                n += m[2 * i + 1]
        return n

    def close(self) -> None:
        self._map[2 * self.slot] = UNUSED
        self._map.close()
