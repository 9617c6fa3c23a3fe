"""A predictive planner for a fleet: size each pool for the load forecast a startup ahead.

The live planner of `pdserve up --autoscale` reacts to missed SLOs one worker at a time, which suits
a host with a handful of processes. A fleet of a hundred workers whose traffic swings through the
day needs what Dynamo's SLA planner does instead: know what one worker sustains within the SLOs
(from the profile: here, the simulator's search at the peak), forecast the load, and set each pool
to forecast ÷ capacity — early enough that the workers have loaded their model when the load comes.

    every interval:  rate of the last interval → linear trend over the last `history` intervals
                     (where it stands out of the noise) → its highest rate between the next
                     interval and `startup_s + interval_s` ahead,
                     × (1 + headroom), + each pool's backlog ÷ interval → workers per pool

The backlog term is what keeps a forecast's miss from lasting: a pool that fell behind holds a queue
that the forecast rate alone would never clear, and TTFT grows with it for the rest of the run. A
queue of up to `queue_per_worker` jobs per worker is the ordinary wait for a free slot, not backlog
(as in the live planner's notion of a hot pool).

Hysteresis: a pool grows as soon as the forecast asks; it shrinks only after `down_after` intervals
in a row that all wanted fewer, and then to the most that any of them wanted (a steady load does not
flip between two counts; a brief dip does not drain workers the next minute needs). Bounds: each
pool within [min, max], both within the budget (if the forecast exceeds it, both pools get their
share of the budget and the SLOs are at risk, which the run reports).

`ForecastScaler` is the simulator's `Scaler` (shared/sim/cluster.py): it sees only the arrivals so
far, never the trace ahead.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Capacity:
    """What one worker of each pool sustains within the SLOs, in requests per second."""

    prefill_rps: float
    decode_rps: float

    def __post_init__(self) -> None:
        if not (self.prefill_rps > 0 and self.decode_rps > 0):
            raise ValueError(f"capacity: req/s per worker must be positive, got {self.prefill_rps}, {self.decode_rps}")

    @classmethod
    def parse(cls, text: str) -> Capacity:
        """From "PREFILL_RPS,DECODE_RPS" (a flag's value, as `pdserve plan` prints it)."""
        try:
            prefill_rps, decode_rps = (float(x) for x in text.split(","))
        except ValueError:
            raise ValueError(f"capacity takes PREFILL_RPS,DECODE_RPS (pdserve plan prints it), got {text!r}") from None
        return cls(prefill_rps, decode_rps)

    @classmethod
    def from_plan(cls, rate: float, prefill: int, decode: int) -> Capacity:
        """From a configuration found to meet the SLOs at `rate` (each pool's share of that rate)."""
        if rate <= 0 or prefill < 1 or decode < 1:
            raise ValueError("capacity: need a positive rate and at least one worker per pool")
        return cls(rate / prefill, rate / decode)


@dataclass
class ForecastScaler:
    capacity: Capacity
    interval_s: float = 60.0
    startup_s: float = 120.0  # a worker's GPUs are paid for from the decision; it serves this much later
    headroom: float = 0.10
    history: int = 5  # intervals the trend is fitted over
    down_after: int = 3  # intervals in a row wanting fewer before a pool shrinks
    min_workers: tuple[int, int] = (1, 1)
    max_workers: tuple[int, int] = (10_000, 10_000)
    budget: int = 20_000  # prefill + decode workers
    queue_per_worker: float = 2.0  # waiting jobs per worker of a pool that are not yet backlog
    rates: deque = field(default_factory=deque)  # observed req/s, one per interval
    current: list[int] | None = None  # the fleet as it stands (set it to start from a running fleet)
    lower: list[list[int]] = field(default_factory=lambda: [[], []])  # recent lower wants per pool
    _last: tuple[float, int] | None = None

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.startup_s < 0 or self.headroom < 0 or self.history < 2 or self.down_after < 1:
            raise ValueError("forecast scaler: need interval > 0, startup >= 0, headroom >= 0, history >= 2, "
                             "down_after >= 1")
        if any(lo < 1 or lo > hi for lo, hi in zip(self.min_workers, self.max_workers)) or \
                sum(self.min_workers) > self.budget:
            raise ValueError("forecast scaler: need 1 <= min <= max per pool and the minimums within the budget")

    def forecast(self) -> float:
        """The most requests per second expected before a worker added now could serve: the
        least-squares line through the last `history` intervals' rates, at its highest from the
        next interval to `startup_s` + one interval ahead (a worker removed now is missing all that
        time; one added now helps only at its end), never below zero. The slope is used only where
        it stands out of the noise (beyond two standard errors, with at least Poisson noise: a rate
        counted over an interval varies by √(rate ÷ interval)); otherwise the forecast is the mean.
        Extrapolating a slope fitted to noise is what makes a predictive planner oscillate."""
        ys = list(self.rates)[-self.history:]
        if len(ys) < 2:
            return ys[-1] if ys else 0.0
        n = len(ys)
        mx, my = (n - 1) / 2, sum(ys) / n
        sxx = sum((i - mx) ** 2 for i in range(n))
        slope = sum((i - mx) * (y - my) for i, y in enumerate(ys)) / sxx
        resid = sum((y - my - slope * (i - mx)) ** 2 for i, y in enumerate(ys)) / (n - 2) if n > 2 else 0.0
        noise = max(resid, my / self.interval_s)
        if abs(slope) < 2 * math.sqrt(noise / sxx):
            slope = 0.0
        ahead = (self.startup_s + self.interval_s) / self.interval_s  # intervals past the last observed one
        return max(0.0, my + slope * (n - 1 - mx + (ahead if slope > 0 else 1.0)))

    def targets_for(self, now: float, arrived: int, waiting: tuple[int, int], have: list[int], leaving: int,
                    budget: int) -> tuple[int, int]:
        """`targets` for a fleet that stands at `have` workers per pool (changed outside or not),
        with `leaving` more still draining: they hold part of `budget` until they are gone."""
        self.current = list(have)
        self.budget = max(sum(self.min_workers), budget - leaving)
        return self.targets(now, arrived, waiting)

    def targets(self, now: float, arrived: int, waiting: tuple[int, int] = (0, 0)) -> tuple[int, int]:
        """Workers wanted per pool, from the arrivals so far and the jobs waiting for each pool now."""
        if self._last is not None and now > self._last[0]:
            self.rates.append((arrived - self._last[1]) / (now - self._last[0]))
            while len(self.rates) > self.history:
                self.rates.popleft()
        self._last = (now, arrived)
        if not self.rates:  # nothing observed yet: keep the fleet as it is
            self.current = list(self.current or self.min_workers)
            return tuple(self.current)
        rate = self.forecast() * (1 + self.headroom)
        want = [rate + max(0.0, q - self.queue_per_worker * n) / self.interval_s for q, n in zip(waiting, self.current)]
        need = [math.ceil(want[0] / self.capacity.prefill_rps - 1e-9), math.ceil(want[1] / self.capacity.decode_rps - 1e-9)]
        need = [min(max(n, lo), hi) for n, lo, hi in zip(need, self.min_workers, self.max_workers)]
        if sum(need) > self.budget:  # each pool its share of the budget
            scale = self.budget / sum(need)
            need = [max(lo, math.floor(n * scale)) for n, lo in zip(need, self.min_workers)]
        for i, n in enumerate(need):
            if n >= self.current[i]:
                self.current[i] = n
                self.lower[i].clear()
            else:
                self.lower[i].append(n)
                if len(self.lower[i]) >= self.down_after:
                    self.current[i] = max(self.lower[i])
                    self.lower[i].clear()
        while sum(self.current) > self.budget:  # a pool held up by hysteresis yields to the one growing
            i = max((0, 1), key=lambda k: self.current[k] - need[k])
            self.current[i] -= 1
        return tuple(self.current)
