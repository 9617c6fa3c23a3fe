"""Engines on one CPU host share its cores, as `pdserve up` runs them (shared/engine/cores.py).

`up` gives each of the n engines present a share of the host's C cores, s = max(1, C // n) threads
(n changes as an autoscaler adds and drains workers; a loading worker is not yet present). Before
each step an engine takes its share plus the shares of the engines idle right now (idle: holding no
sequence), and keeps those threads to the step's end; a decode or colocated engine borrows only for
a step that computes a prompt's chunk or holds two or more sequences. Here the cores go first to
the shares of the engines holding sequences (evenly, when those shares oversubscribe the host); what
no holding engine's share takes goes to the borrowers. A step on c cores takes its fitted time × a
factor per part of it:

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
four engines on 2 cores (a core's share each: 3 + 1, 1 + 3) get half a core each while all hold
sequences. The prefill worker runs at nice 10, but weighting the cores by nice (CFS: 110 against
1,024) made 1 + 3 on this host's chat 3× too slow to prefill and its decode 3× too fast; evenly,
within 20–40% (BENCHMARKS.md, "Engines on one host's cores").

A decode step's width, where the profile has `decode_wide` (a calibration read the served engine's
steps on its own share and on the whole host apart): the decode part is then the share's fit on up
to C/2 cores (sliced below a core, as above), the whole host's on C, and in between their mix by
the cores beyond C/2. Served, more threads do not make a decode step uniformly faster: on 2
cores a step on both pays ~5 ms more a step and half as much a row, so a lone stream steps about
as fast on one core and a batch of eight streams much faster on two (`Profile.wide_decode_ratio`;
BENCHMARKS.md, "A decode step's width").
"""

from __future__ import annotations

import math

BORROW_FROM = {"prefill": 1, "decode": 2, "colocated": 2}  # sequences a step needs to borrow (AsyncEngine)


class HostCores:
    """The cores of one host and the engines holding sequences on them."""

    def __init__(self, cores: int, engines: int, unlent: tuple[float, float], wide: bool = False):
        """`wide`: the profile fits a decode step's width (`decode_wide`): `factors` takes the ratio."""
        if cores < 1 or engines < 1:
            raise ValueError(f"a host needs cores and engines, got {cores} and {engines}")
        self.cores, self.wide = cores, wide
        self.engines(engines)  # each one's share
        self.calib_share = max(1, cores // 2)  # the calibration's 1 + 1 engines
        # exponents of the parallel speed-up, (prefill part, decode part)
        self.exponent = tuple(math.log(u) / math.log(cores / self.calib_share) if cores > self.calib_share else 0.0
                              for u in unlent)
        if wide:  # the decode part's width is the two fits': the calibration's slowdown is theirs
            self.exponent = (self.exponent[0], 0.0)

    def engines(self, n: int) -> None:
        """`n` engines on the host now: each one's share is the cores divided among them (`pdserve
        up`'s fair share, which follows the autoscaler's workers as they come and go)."""
        self.share = max(1, self.cores // max(1, n))
        # engine holding sequences → threads of its step (its share between); None: to divide anew
        self.holding: dict[object, int] | None = None

    def step_threads(self, role: str, sequences: int, prefilling: bool, idle: int) -> int:
        """Threads an engine takes for a step: its share, plus the idle engines' when it may borrow
        (a prompt to compute, or enough sequences)."""
        return self.share * (1 + idle) if prefilling or sequences >= BORROW_FROM[role] else self.share

    def allocate(self, holding: dict[object, int]) -> dict[object, float]:
        """The cores each engine of `holding` (engine → threads of its step) gets: its own share, or
        an even part of the host when the holding engines' shares oversubscribe it; then the cores
        no holding engine's share takes go to the borrowers, by threads borrowed."""
        over = min(1.0, self.cores / (self.share * len(holding))) if holding else 1.0
        own = dict.fromkeys(holding, self.share * over)
        free = self.cores - sum(own.values())
        borrowing = {e: t - self.share for e, t in holding.items() if t > self.share}
        wanted = sum(borrowing.values())
        return {e: own[e] + (min(borrowing[e], free * borrowing[e] / wanted) if e in borrowing else 0.0) for e in own}

    def factors(self, role: str, sequences: int, cores: float, wide_ratio: float = 1.0) -> tuple[float, float]:
        """(prefill part, decode part) step-time factors of a step that gets `cores`: against a
        prefill step on the whole host, a decode step on the whole host (two or more sequences) or
        on the calibration's share (one). With the width fitted (`wide`), the decode part is against
        the share's step, and `wide_ratio` is the whole host's step ÷ the share's at this batch."""
        prefill = _speed(self.cores, self.exponent[0]) / _speed(cores, self.exponent[0])
        if self.wide:
            if cores <= self.calib_share:
                return prefill, _speed(self.calib_share, self.exponent[1]) / _speed(cores, self.exponent[1])
            beyond = min(1.0, (cores - self.calib_share) / (self.cores - self.calib_share))
            return prefill, 1.0 + (wide_ratio - 1.0) * beyond
        decode_ref = self.cores if sequences >= 2 else self.calib_share
        return prefill, _speed(decode_ref, self.exponent[1]) / _speed(cores, self.exponent[1])


def _speed(cores: float, exponent: float) -> float:
    """A step's speed on `cores`: parallel speed-up from one core, linear below it (a sliced thread)."""
    return cores ** exponent if cores >= 1 else cores
