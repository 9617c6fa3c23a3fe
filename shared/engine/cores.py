"""Engines on one host lend each other their cores while idle.

`pdserve up` gives each engine worker a share of the host's cores. With a fixed split, a decode
worker under chat load runs on half the machine while the prefill worker beside it waits for the
next prompt. Here every worker publishes, in a small shared file, whether it is stepping; before
each step a worker runs with its own share plus the shares of the workers that are idle right now:

    slot i:  [state, share]     state 0 = unused, 1 = idle, 2 = busy
                                share = its own threads, or 0: a fair share

A fair share is the host's cores less the explicit shares, divided among the fair workers present,
so it follows the workers as they come and go (the autoscaler's: four workers started on 16 cores
take 4 threads each, and after two are drained the other two take 8). An explicit share is a
worker's `--threads`, fixed.

A worker that turns busy takes back its share at its next step; the one that borrowed it gives it
back at *its* next step, so the machine is oversubscribed for at most one step of the borrower.
A worker that dies while busy leaves its slot busy: nobody borrows its cores (the safe side) until
it restarts in the same slot. A worker that exits cleanly frees its slot.
"""

from __future__ import annotations

import logging
import mmap
import os
from pathlib import Path

log = logging.getLogger(__name__)

SLOTS = 64
UNUSED, IDLE, BUSY = 0, 1, 2
FAIR = 0  # the share byte of a worker whose share is the host's cores divided among the workers present


def host_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class CoreShare:
    def __init__(self, path: str | Path, slot: int, share: int | None, cores: int | None = None):
        """`share`: this worker's threads, or None for a fair share of the host's `cores` (default:
        the cores this process may run on)."""
        if not 0 <= slot < SLOTS:
            raise ValueError(f"core-share slot must be in [0, {SLOTS}), got {slot}")
        if share is not None and not 1 <= share <= 255:
            raise ValueError(f"core share must be in [1, 255] threads, got {share}")
        self.slot, self._share = slot, share
        self.cores = cores or host_cores()
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < 2 * SLOTS:
                os.ftruncate(fd, 2 * SLOTS)
            self._map = mmap.mmap(fd, 2 * SLOTS)
        finally:
            os.close(fd)
        self._map[2 * slot + 1] = FAIR if share is None else share
        self._state = -1
        self._closed = False
        self.set_busy(False)

    def set_busy(self, busy: bool) -> None:
        state = BUSY if busy else IDLE
        if state != self._state and not self._closed:
            self._map[2 * self.slot] = state
            self._state = state

    def _read(self) -> tuple[int, int]:
        """(this worker's share, the shares of the idle others), read from the file in one pass."""
        data = self._map[:2 * SLOTS]
        explicit = fair = idle_explicit = idle_fair = 0
        for i in range(SLOTS):
            state, share = data[2 * i], data[2 * i + 1]
            if state == UNUSED:
                continue
            lent = state == IDLE and i != self.slot
            if share == FAIR:
                fair += 1
                idle_fair += lent
            else:
                explicit += share
                idle_explicit += share * lent
        fair_share = max(1, (self.cores - explicit) // fair) if fair else 0
        return self._share or fair_share, idle_explicit + idle_fair * fair_share

    @property
    def share(self) -> int:
        """Threads for a step that borrows nothing."""
        return self._read()[0]

    def threads(self) -> int:
        """Threads for the next step: this worker's share plus the shares of the idle others."""
        own, lent = self._read()
        return own + lent

    def close(self) -> None:
        """Free the slot (the worker is leaving); its steps from now on borrow and lend nothing."""
        if not self._closed:
            self._map[2 * self.slot] = UNUSED
            self._closed = True
