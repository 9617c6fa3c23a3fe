"""Keeps the child processes of `pdserve up` running, as compose's `restart: unless-stopped` or a
Kubernetes restart policy would: one process dying is an incident, not the end of the stack.

    poll() every ~0.2 s:
      a child exited           → log its exit code and log tail; restart it after its backoff
      backoff                  0.5 s, doubling up to 30 s; back to 0.5 s once the child has stayed
                               up `stable_s` (a crash an hour later is not part of a crash loop)
      crash loop               `max_quick_failures` exits in a row, each within `stable_s` of its
                               start → `CrashLoop` (names the child, its exit code and log tail);
                               the caller stops everything and exits non-zero
    retire(name)               SIGTERM one child for good (the autoscaler removing a worker): it
                               drains and exits, and is then forgotten, not restarted
    stop()                     SIGTERM by stage, highest first (gateway, then the workers together,
                               then the kvstore, then the servers), waiting for each stage to exit;
                               SIGKILL for one that outlives the timeout

Each child is started with `die_with_parent` (it gets SIGTERM if `up` itself dies) in its own
session (Ctrl-C reaches `up` only, which then stops them in order).
"""

from __future__ import annotations

import logging
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("pdserve.up")

LOG_TAIL_BYTES = 2000


def exit_description(returncode: int) -> str:
    """`killed by SIGKILL` for a negative Popen return code, else `exit code N`."""
    if returncode < 0 and -returncode in signal.valid_signals():
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exit code {returncode}"


@dataclass(frozen=True)
class RestartPolicy:
    initial_backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    stable_s: float = 30.0  # up this long: the next exit starts a fresh backoff (a model load takes ~5-15 s here)
    max_quick_failures: int = 3  # this many exits in a row within stable_s of starting: give up

    def __post_init__(self) -> None:
        if not 0 < self.initial_backoff_s <= self.max_backoff_s:
            raise ValueError("restart policy: need 0 < initial_backoff_s <= max_backoff_s")
        if self.stable_s <= 0 or self.max_quick_failures < 1:
            raise ValueError("restart policy: stable_s must be > 0 and max_quick_failures >= 1")


class CrashLoop(RuntimeError):
    """A child keeps exiting right after it starts: restarting it again will not help."""

    def __init__(self, name: str, returncode: int, failures: int, tail: str):
        lines = [line for line in tail.splitlines() if line.strip()]
        last = lines[-1].strip() if lines else "(no output)"
        super().__init__(f"{name} keeps crashing: it exited {failures} times in a row right after starting "
                         f"(last: {exit_description(returncode)}): {last}\nits last output:\n{tail}")
        self.name, self.returncode, self.tail = name, returncode, tail


@dataclass
class Child:
    """One supervised process: how to (re)start it, where it logs, and its restart state."""

    name: str
    spawn: Callable[[], subprocess.Popen]
    log_path: Path
    stage: int = 0  # stop order: higher stages stop first, one stage at a time
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    restarts: int = 0
    quick_failures: int = 0  # consecutive exits within stable_s of starting
    backoff_s: float = 0.0
    restart_at: float | None = None  # set while the child is down, waiting out its backoff
    retiring: bool = False  # SIGTERMed for good: once it exits it is forgotten, not restarted
    on_restart: list[Callable[[subprocess.Popen], None]] = field(default_factory=list)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, 2)
                f.seek(max(0, f.tell() - LOG_TAIL_BYTES))
                return f.read().decode(errors="replace")
        except OSError as exc:
            return f"(no log: {exc})"


class Supervisor:
    def __init__(self, policy: RestartPolicy | None = None, clock: Callable[[], float] = time.monotonic):
        self.policy = policy or RestartPolicy()
        self.clock = clock
        self.children: list[Child] = []
        self._stopping = False

    def start(self, name: str, spawn: Callable[[], subprocess.Popen], log_path: Path, stage: int = 0) -> Child:
        child = Child(name, spawn, log_path, stage, backoff_s=self.policy.initial_backoff_s)
        self.children.append(child)
        self._launch(child)
        return child

    def adopt(self, name: str, proc: subprocess.Popen, spawn: Callable[[], subprocess.Popen], log_path: Path,
              stage: int = 0) -> Child:
        """Supervise a process someone else started (the embedded servers, which wait for their port)."""
        child = Child(name, spawn, log_path, stage, proc=proc, started_at=self.clock(),
                      backoff_s=self.policy.initial_backoff_s)
        self.children.append(child)
        return child

    def child(self, name: str) -> Child:
        for child in self.children:
            if child.name == name:
                return child
        raise KeyError(f"no child named {name!r}")

    def retire(self, name: str) -> None:
        """Stop one child for good: SIGTERM (a worker drains: takes no new jobs, finishes its own);
        `poll` forgets it once it has exited."""
        child = self.child(name)
        child.retiring, child.restart_at = True, None
        if child.running:
            child.proc.send_signal(signal.SIGTERM)

    def has(self, name: str) -> bool:
        """`name` is supervised: running, waiting to restart, or retiring and not yet exited."""
        return any(child.name == name for child in self.children)

    def poll(self) -> None:
        """Notice exits and restart due children; raises CrashLoop when a child will not stay up."""
        if self._stopping:
            return
        now = self.clock()
        for child in list(self.children):
            if child.retiring:
                if not child.running:
                    log.info("%s retired (%s after draining)", child.name, exit_description(child.proc.returncode)
                             if child.proc is not None else "never started")
                    self.children.remove(child)
                continue
            if child.restart_at is not None:
                if now >= child.restart_at:
                    child.restarts += 1
                    self._launch(child)
                continue
            if child.proc is None or child.proc.poll() is None:
                continue
            self._on_exit(child, now)

    def _on_exit(self, child: Child, now: float) -> None:
        code = child.proc.returncode
        uptime = now - child.started_at
        tail = child.tail()
        if uptime >= self.policy.stable_s:  # it had been up a while: a new incident, not a loop
            child.quick_failures = 0
            child.backoff_s = self.policy.initial_backoff_s
        child.quick_failures += 1
        how = exit_description(code)
        if child.quick_failures >= self.policy.max_quick_failures:
            log.error("%s exited (%s) after %.1f s, %d times in a row: giving up", child.name, how, uptime,
                      child.quick_failures)
            raise CrashLoop(child.name, code, child.quick_failures, tail)
        log.error("%s exited (%s) after %.1f s; restarting it in %.1f s. Its last output:\n%s",
                  child.name, how, uptime, child.backoff_s, tail)
        child.restart_at = now + child.backoff_s
        child.backoff_s = min(child.backoff_s * 2, self.policy.max_backoff_s)

    def _launch(self, child: Child) -> None:
        child.proc = child.spawn()
        child.started_at = self.clock()
        child.restart_at = None
        for hook in child.on_restart:
            hook(child.proc)
        log.info("started %s (pid %d)%s, log %s", child.name, child.proc.pid,
                 f" (restart {child.restarts})" if child.restarts else "", child.log_path)

    def stop(self, timeout: float = 15.0) -> None:
        """Stop the children stage by stage, highest first: SIGTERM the stage, wait up to `timeout`
        for it, SIGKILL what is left. Order matters: the gateway ends its open streams while the
        workers still serve; the workers drain while the kvstore and NATS are still there."""
        self._stopping = True
        for stage in sorted({child.stage for child in self.children}, reverse=True):
            group = [child for child in self.children if child.stage == stage]
            for child in group:
                child.restart_at = None
                if child.running:
                    child.proc.send_signal(signal.SIGTERM)
            deadline = self.clock() + timeout
            for child in group:
                if child.proc is None:
                    continue
                try:
                    child.proc.wait(max(0.1, deadline - self.clock()))
                except subprocess.TimeoutExpired:
                    log.warning("%s did not stop within %.0f s: killing it", child.name, timeout)
                    child.proc.kill()
                    child.proc.wait()
