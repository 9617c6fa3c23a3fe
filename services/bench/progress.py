"""A one-line progress display on stderr: a bar when the total is known, counts and time otherwise.
On a terminal it redraws in place; elsewhere (a log, a pipe) it prints a line every few seconds."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, label: str, total: int | None, enabled: bool = True, stream: TextIO = sys.stderr,
                 log_every_s: float = 10.0):
        self.label, self.total, self.enabled, self.stream = label, total, enabled, stream
        self.done = self.failed = 0
        self._drawn = -1  # `done` when last drawn
        self.start = self._last_line = time.monotonic()
        self.tty = stream.isatty()
        self.log_every_s = log_every_s

    def update(self, ok: bool) -> None:
        self.done += 1
        self.failed += 0 if ok else 1
        now = time.monotonic()
        if self.enabled and (self.tty or now - self._last_line >= self.log_every_s):
            self._last_line = now
            self._draw(end="\r" if self.tty else "\n")

    def close(self) -> None:
        if self.enabled and (self.tty or self._drawn != self.done):
            self._draw(end="\n")

    def _draw(self, end: str) -> None:
        self._drawn = self.done
        elapsed = time.monotonic() - self.start
        if self.total:
            filled = int(30 * self.done / self.total)
            bar = f"[{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total}"
        else:
            bar = f"{self.done} done"
        failed = f", {self.failed} failed" if self.failed else ""
        self.stream.write(f"{self.label}: {bar}{failed}, {elapsed:.1f} s{end}")
        self.stream.flush()
