"""Engines on one CPU host share its cores, as `pdserve up` runs them (shared/engine/cores.py).

`up` gives each of its n engines a share of the host's C cores, s = max(1, C // n) threads. Before
each step an engine takes its share plus the shares of the engines idle right now (idle: holding no
sequence), and keeps those threads to the step's end; a decode or colocated engine borrows only for
a step that computes a prompt's chunk or holds two or more sequences. Here the cores go first to
the shares of the engines holding sequences, weighted by nice (a prefill worker runs at nice 10, CFS
weight 110; decode and colocated engines at nice 0, 1024), at most a core a thread; what no holding
engine's share takes goes to the borrowers. A step on c cores takes its fitted time × a factor per
part of it:

    prefill part   speed(C) / speed(c)         speed(c) = c^a for c ≥ 1 (parallel speed-up), c below
    decode part    speed(ref) / speed(c)       a core (a thread sliced); a = log2 of the calibrated
                                               slowdown at half the host (`Profile.unlent`: prefill
                                               ~1.9 on 2 cores → a ≈ 0.92; decode ~1.0 → 0)

The fits are of a calibration's 1 prefill + 1 decode engine (C/2 threads each): a prefill step on
the whole host (the decode engine idle), a decode step of two or more sequences on the whole host
(ref = C), a decode step of one on its own share (ref = C/2). On 2 cores with 1 + 1 engines this is
the model the calibration measures: a prefill step beside a decode worker holding sequences takes
×1.9, a batch-1 decode step never borrows. It also says what the calibration does not see: two
colocated engines prefill on a core each while both hold sequences and on both while one is idle;
three prefill workers and a decode worker on 2 cores (a core's share each) leave the decode worker
its core (nice 0) and divide the other three ways.
"""

from __future__ import annotations

import math

NICE_WEIGHT = {"prefill": 110, "decode": 1024, "colocated": 1024}  # CFS weights of nice 10 and nice 0
BORROW_FROM = {"prefill": 1, "decode": 2, "colocated": 2}  # sequences a step needs to borrow (AsyncEngine)


class HostCores:
    """The cores of one host and the engines holding sequences on them."""

    def __init__(self, cores: int, engines: int, unlent: tuple[float, float]):
        if cores < 1 or engines < 1:
            raise ValueError(f"a host needs cores and engines, got {cores} and {engines}")
        self.cores = cores
        self.share = max(1, cores // engines)  # `pdserve up --threads` default
        self.calib_share = max(1, cores // 2)  # the calibration's 1 + 1 engines
        # exponents of the parallel speed-up, (prefill part, decode part)
        self.exponent = tuple(math.log(u) / math.log(cores / self.calib_share) if cores > self.calib_share else 0.0
                              for u in unlent)
        self.holding: dict[object, int] = {}  # engine holding sequences → threads of its step (its share between)

    def step_threads(self, role: str, sequences: int, prefilling: bool, idle: int) -> int:
        """Threads an engine takes for a step: its share, plus the idle engines' when it may borrow
        (a prompt to compute, or enough sequences)."""
        return self.share * (1 + idle) if prefilling or sequences >= BORROW_FROM[role] else self.share

    def allocate(self, holding: dict[object, int]) -> dict[object, float]:
        """The cores each engine of `holding` (engine → threads of its step) gets. Its own share
        first, weighted by nice, at most a core a thread (water-filling: threads whose fair part
        exceeds a core get one, the rest is shared again); the cores no holding engine's share takes
        go to the borrowers, by threads borrowed."""
        own: dict[object, float] = {}
        pending = dict.fromkeys(holding, self.share)
        total = sum(NICE_WEIGHT[e.role] * n for e, n in pending.items())
        # no less than its weight's part of the host: a nice-10 thread shares a core with a nice-0 one
        # and still gets its ~10% of it (the OS balances runqueues per core, not globally)
        floor = {e: n * min(1.0, self.cores * NICE_WEIGHT[e.role] / total) for e, n in pending.items()}
        left = float(self.cores)
        while pending:
            weight = sum(NICE_WEIGHT[e.role] * n for e, n in pending.items())
            capped = [e for e in pending if left * NICE_WEIGHT[e.role] / weight >= 1.0]
            if not capped:
                for e, n in pending.items():
                    own[e] = n * left * NICE_WEIGHT[e.role] / weight
                break
            for e in capped:
                own[e] = pending.pop(e)
                left -= own[e]
        own = {e: max(c, floor[e]) for e, c in own.items()}
        free = max(0.0, self.cores - sum(own.values()))  # (the floors may overcommit a little)
        borrowing = {e: t - self.share for e, t in holding.items() if t > self.share}
        wanted = sum(borrowing.values())
        return {e: own[e] + (min(borrowing[e], free * borrowing[e] / wanted) if e in borrowing else 0.0) for e in own}

    def factors(self, role: str, sequences: int, cores: float) -> tuple[float, float]:
        """(prefill part, decode part) step-time factors of a step that gets `cores`: against a
        prefill step on the whole host, a decode step on the whole host (two or more sequences) or
        on the calibration's share (one)."""
        decode_ref = self.cores if sequences >= 2 else self.calib_share
        return (_speed(self.cores, self.exponent[0]) / _speed(cores, self.exponent[0]),
                _speed(decode_ref, self.exponent[1]) / _speed(cores, self.exponent[1]))


def _speed(cores: float, exponent: float) -> float:
    """A step's speed on `cores`: parallel speed-up from one core, linear below it (a sliced thread)."""
    return cores ** exponent if cores >= 1 else cores
