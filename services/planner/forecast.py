"""A predictive planner for a fleet: size each pool for the load forecast a startup ahead.

The live planner of `pdserve up --autoscale` reacts to missed SLOs one worker at a time, which suits
a host with a handful of processes. A fleet of a hundred workers whose traffic swings through the
day needs what Dynamo's SLA planner does instead: know what one worker sustains within the SLOs
(from the engine profile and the requests' mix), forecast the load, and set each pool to what the
forecast needs — early enough that the workers have loaded their model when the load comes.

    every interval:  arrivals of the last interval → linear trend over the last `history` intervals
                     (more where the rate is a trickle; fewer where the arrivals stopped), where
                     it stands out of the noise → its highest rate between the next
                     interval and `startup_s + interval_s` ahead (raised where the last 2·`history`
                     intervals bend upwards beyond the noise: the load turning up from a trough;
                     lowered where they bend down: a rise levelling off towards its peak),
                     × (1 + the pool's headroom), + the pool's backlog ÷ interval → the sizer:
                     workers per pool
    with `season_s` (the load's period, a day), once a whole period is seen: instead of the line, the
                     load a period ago over the same horizon, scaled to today's level, wherever that
                     shape explains the latest intervals (`_seasonal`): the turns are foreseen

The backlog term is what keeps a forecast's miss from lasting: a pool that fell behind holds a queue
that the forecast rate alone would never clear, and TTFT grows with it for the rest of the run. A
queue of up to `queue_per_worker` jobs per worker is the ordinary wait for a free slot, not backlog
(as in the live planner's notion of a hot pool).

Hysteresis: a pool grows as soon as the forecast asks; it shrinks only after `down_after` intervals
in a row that all wanted fewer, and then to the most that any of them wanted (a steady load does not
flip between two counts; a brief dip does not drain workers the next minute needs). Where the load
declines beyond chance (4 intervals or more on a line within their noise, falling by more than 3
standard errors: not a dip, nor a step down that a line would carry on), after `down_after_falling`:
on the planning study's daily swing, holding a declining pool three intervals longer cost ~3% of
the hour's GPU time (BENCHMARKS.md). A decline once seen holds while the slope does (its points may
stray from the line: a decline that levels off bends), and a forecast raised by a bend towards the
turn is followed down too: until 2026-12-07 either ended the decline, for noise or for the bend, and
the pools waited their three intervals again (1.5% of the study's GPU time). Bounds: each
pool within [min, max], both within the budget (if the forecast exceeds it, both pools get their
share of the budget and the SLOs are at risk, which the run reports). The budget is in `gpus`: what
a worker of each pool holds (a TP4 prefill pod 4, a TP8 decode pod 8), or 1 each, counting workers.

How many workers a rate needs comes from a sizer:
  * `Capacity`: req/s one worker of each pool carries, given (`pdserve plan` prints it for the load
    it searched) — right for that load's mix of requests and no other;
  * `ProfileSizer` (the default): from the engine profile and the mix of the requests that finished
    lately (their prefill seconds, prompt and output tokens, as the gateway's counters show them), a
    queueing model per pool — nothing searched or given by hand, and it follows a change of mix
    (documents instead of chat) that a fixed req/s per worker would get wrong.

`ForecastScaler` is the simulator's `Scaler` (shared/sim/cluster.py): it sees only the arrivals so
far, never the trace ahead.
"""

from __future__ import annotations

import argparse
import bisect
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from statistics import NormalDist
from typing import ClassVar, Protocol

from shared.sim.cost import Profile
from shared.sim.workload import Load, Mix


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

    def workers(self, pool: int, rate: float, mix: Mix | None) -> int:
        return math.ceil(rate / (self.prefill_rps, self.decode_rps)[pool] - 1e-9)

    def describe(self) -> dict:
        return {"capacity_rps_per_worker": {"prefill": self.prefill_rps, "decode": self.decode_rps}}

    def __str__(self) -> str:
        return f"{self.prefill_rps:g} and {self.decode_rps:g} req/s a prefill and a decode worker"


class Sizer(Protocol):
    def workers(self, pool: int, rate: float, mix: Mix | None) -> int | None:
        """Workers pool 0 (prefill) or 1 (decode) needs for `rate` req/s of `mix` within the SLOs
        (None: it cannot tell yet — no request has finished)."""
        ...

    def describe(self) -> dict: ...  # for a results file

    def __str__(self) -> str: ...  # for a log line


def headroom_arg(text: str) -> float | tuple[float, float]:
    """A `--headroom` flag's value: H (both pools), or PREFILL,DECODE; each a fraction >= 0."""
    try:
        parts = [float(x) for x in text.split(",")]
    except ValueError:
        parts = []
    if len(parts) not in (1, 2) or min(parts) < 0:
        raise argparse.ArgumentTypeError(f"takes H or PREFILL,DECODE, fractions >= 0 (0.05: 5% above the "
                                         f"forecast), got {text!r}")
    return parts[0] if len(parts) == 1 else (parts[0], parts[1])


def _erlang_c(c: int, a: float, b_prev: float) -> tuple[float, float]:
    """(Erlang C, Erlang B) for c servers at offered load a, from Erlang B at c − 1 (B(0) = 1)."""
    b = a * b_prev / (c + a * b_prev)
    return (c * b / (c - a * (1 - b)) if c > a else 1.0), b


def _servers(a: float, late: Callable[[int, float], float], target: float, limit: int = 1_000_000) -> int:
    """The fewest servers c (an M/M/c queue at offered load `a` Erlangs) with late(c, C(c)) <= target."""
    b, c = 1.0, 0
    while c < limit:
        c += 1
        erlang_c, b = _erlang_c(c, a, b)
        if c > a and late(c, erlang_c) <= target:
            return c
    return limit


def _surprise(n1: float, t1: float, n2: float, t2: float) -> float:
    """How unlikely it is that n1 arrivals in t1 seconds and n2 in t2 came at one Poisson rate: the
    log-likelihood ratio of two rates against one (by chance above s with probability about e^-s).
    n2 arrivals in t2, then none for t1, score n2·ln(1 + t1 ÷ t2): after 10 arrivals, a quiet of 8
    of their mean gaps scores 6."""
    r = (n1 + n2) / (t1 + t2)

    def d(n: float, mu: float) -> float:  # Poisson deviance / 2 of n against a mean mu
        return mu - n + (n * math.log(n / mu) if n > 0 else 0.0)

    return d(n1, r * t1) + d(n2, r * t2) if r > 0 else 0.0


@dataclass(frozen=True)
class ProfileSizer:
    """Workers per pool from the engine profile and the recent mix, within the SLOs met by
    `attainment` of requests — what Dynamo's SLA planner reads off its pre-deployment profile, here
    with the queueing each pool does:

      prefill  an M/M/c queue: a request's TTFT is its wait for a worker plus its own prefill
               (the mix's mean prefill seconds); the fewest workers with P(TTFT > SLO) within
               1 − attainment. A pool of many workers runs nearer full than one of two.
      decode   the larger of two needs. Batch: the most sequences one step may hold with its time
               per token within the TPOT SLO (the profile's decode fit at the mix's mean context,
               prompt + output/2) and their KV in the block budget, less z·√B for the batch's
               Poisson swing; a worker then carries B ÷ (output tokens × step) req/s (Little).
               Intake: each worker reads one job's KV at a time (the prompt's bytes over
               `kv_path`), an M/M/c queue whose wait may use the TPOT slack of the request's
               output tokens.

    Prefill is priced by the mix's prefill seconds, which a live gateway measures; decode by the
    profile's step, times what the scaler observed of it (`Mix.decode_factor`: ForecastScaler.
    observe_decode). Nothing else corrects a profile of other hardware than the fleet's."""

    profile: Profile
    slo_ttft_s: float
    slo_tpot_s: float
    attainment: float = 0.95
    kv_path: str = "network"

    def __post_init__(self) -> None:
        if not (self.slo_ttft_s > 0 and self.slo_tpot_s > 0 and 0.5 <= self.attainment < 1):
            raise ValueError("profile sizer: need positive SLOs and 0.5 <= attainment < 1")

    def __str__(self) -> str:
        return (f"each pool sized from the profile of {self.profile.meta.get('model', '?')} and the recent "
                f"requests' mix ({self.attainment:.0%} within the SLOs)")

    def describe(self) -> dict:
        return {"sizer": "profile", "model": self.profile.meta.get("model"), "slo_ttft_s": self.slo_ttft_s,
                "slo_tpot_s": self.slo_tpot_s, "attainment": self.attainment, "kv_path": self.kv_path}

    def workers(self, pool: int, rate: float, mix: Mix | None) -> int | None:
        if mix is None:
            return None
        if rate <= 0:
            return 0
        return self.prefill_workers(rate, mix) if pool == 0 else self.decode_workers(rate, mix)

    def prefill_workers(self, rate: float, mix: Mix) -> int:
        s = max(mix.prefill_s, 1e-6)
        mu, t = 1 / s, max(0.0, self.slo_ttft_s - self.profile.request_overhead_s)
        late_cap = 1 - self.attainment

        def late(c: int, erlang_c: float) -> float:
            """P(wait + service > t): the wait is 0, or (with probability C) Exp(μ(c − a)); service ~ Exp(μ)."""
            a_rate = mu * (c - rate * s)
            both = (math.exp(-mu * t) if abs(a_rate - mu) < 1e-9 * mu * (1 + mu * t) else
                    (mu * math.exp(-a_rate * t) - a_rate * math.exp(-mu * t)) / (mu - a_rate))
            return (1 - erlang_c) * math.exp(-mu * t) + erlang_c * both

        if math.exp(-mu * t) > late_cap:  # the prompts alone outlast the SLO too often: queue seldom
            return _servers(rate * s, lambda c, erlang_c: erlang_c, late_cap)
        return _servers(rate * s, late, late_cap)

    def _per_seq(self, mix: Mix) -> float:
        """What one more sequence of the mix adds to a decode step (at its mean context)."""
        d = self.profile.decode
        return d.per_seq_s + d.per_ctx_token_s * (mix.prompt_tokens + mix.output_tokens / 2)

    def step(self, batch: float, mix: Mix) -> float:
        """A decode step's seconds per token for `batch` sequences of the mix, by the profile alone."""
        return self.profile.decode.base_s + batch * self._per_seq(mix)

    def batch(self, mix: Mix) -> tuple[int, float]:
        """(sequences a decode worker holds at once, its step's seconds per token there), the profile's
        step scaled by what was observed (`mix.decode_factor`)."""
        d, lim, f = self.profile.decode, self.profile.limits, mix.decode_factor
        per_seq = self._per_seq(mix)
        slo = self.slo_tpot_s / f
        by_step = math.floor((slo - d.base_s) / per_seq) if slo > d.base_s else 1
        by_kv = lim.num_kv_blocks // max(1, math.ceil((mix.prompt_tokens + mix.output_tokens) / lim.block_size))
        most = max(1, min(by_step, by_kv, lim.max_num_seqs))
        z = NormalDist().inv_cdf(self.attainment)
        b = max(1, math.floor(((math.sqrt(z * z + 4 * most) - z) / 2) ** 2))  # b + z·√b <= most
        return b, f * (d.base_s + b * per_seq)

    def decode_workers(self, rate: float, mix: Mix) -> int:
        b, step = self.batch(mix)
        by_batch = math.ceil(rate * mix.output_tokens * step / b - 1e-9)
        lim = self.profile.limits
        kv = math.ceil(mix.prompt_tokens / lim.block_size) * lim.kv_bytes_per_block
        read = self.profile.transfer_time(self.kv_path, kv)[1]
        slack = max(0.0, self.slo_tpot_s - step) * max(0.0, mix.output_tokens - 1)
        by_intake = _servers(rate * read, lambda c, erlang_c: erlang_c * math.exp(-(c - rate * read) * slack / read),
                             1 - self.attainment)
        return max(by_batch, by_intake)


@dataclass
class ForecastScaler:
    sizer: Sizer
    BEND_Z: ClassVar[float] = 3.0  # standard errors of a parabola's curvature that make a bend (_bend)
    FALL_Z: ClassVar[float] = 3.0  # … of the line's slope that make a decline (`falling`)
    SMOOTH: ClassVar[float] = 5.0  # intervals a season ago's rate is a mean over (_rate_then)
    DRIFT_Z: ClassVar[float] = 3.0  # … of a trend in the misses of a season ago that make it another (_seasonal)
    interval_s: float = 60.0
    startup_s: float = 120.0  # a worker's GPUs are paid for from the decision; it serves this much later
    # capacity above the forecast: one for both pools, or (prefill, decode). The planning study's fleet wants
    # more on decode, whose miss is cheap to cover (a fifth of the GPUs), than on prefill (BENCHMARKS.md)
    headroom: float | tuple[float, float] = 0.10
    history: int = 5  # intervals the trend is fitted over
    down_after: int = 3  # intervals in a row wanting fewer before a pool shrinks
    down_after_falling: int = 1  # … while the forecast line falls beyond 3 standard errors (forecast())
    min_workers: tuple[int, int] = (1, 1)
    max_workers: tuple[int, int] = (10_000, 10_000)
    budget: int = 20_000  # prefill + decode workers, each weighed by `gpus`
    gpus: tuple[int, int] = (1, 1)  # what a worker of each pool holds of the budget (GPUs; or 1: a worker)
    queue_per_worker: float = 2.0  # waiting jobs per worker of a pool that are not yet backlog
    mix_requests: int = 200  # the mix: of the latest intervals that finished this many (a change shows soon)
    rate_requests: int = 10  # the trend is fitted over intervals that hold this many arrivals, where it takes more
    max_history: int = 30  # …but at most this many intervals
    surprise: float = 6.0  # a change in the arrivals this unlikely by chance (e^-surprise) ends the window
    curvature: bool = True  # also fit a parabola: a turn at a trough or a peak is foreseen (forecast())
    # workers per pool it never goes below at a time (`now` as `targets` gets it): a schedule planned from a
    # forecast of the load (schedule.Schedule), so the known pattern is in place ahead, the surprises followed
    floor: Callable[[float], tuple[int, int]] | None = None
    # the load's period (a day: 86400 s), where it has one: once a whole period has been seen, the forecast is
    # what the load did a period ago, scaled to today's level, wherever that explains the latest intervals
    season_s: float | None = None
    season_noise: float = 0.03  # how far a period's shape strays from the last one's beyond chance (relative)
    seen: list = field(default_factory=list)  # with season_s: (start s, end s, arrivals) per interval, a season back
    arrivals: deque = field(default_factory=deque)  # (requests, seconds), one per interval
    loads: deque = field(default_factory=deque)  # finished work, one Load per interval (the mix's window)
    mix: Mix | None = None  # of the requests finished lately (the last known, if none were)
    decode_factor: float = 1.0  # observed decode step ÷ the profile's (a moving average; 1 until seen)
    current: list[int] | None = None  # the fleet as it stands (set it to start from a running fleet)
    lower: list[list[int]] = field(default_factory=lambda: [[], []])  # recent lower wants per pool
    falling: bool = False  # the last forecast's line fell beyond FALL_Z standard errors: no dip of chance
    _last: tuple[float, int] | None = None
    _last_load: Load | None = None

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.startup_s < 0 or min(self.headrooms) < 0 or not 2 <= self.history <= \
                self.max_history or min(self.down_after, self.down_after_falling) < 1 or self.surprise <= 0:
            raise ValueError("forecast scaler: need interval > 0, startup >= 0, headroom >= 0, "
                             "2 <= history <= max_history, down_after(_falling) >= 1, surprise > 0")
        if any(lo < 1 or lo > hi for lo, hi in zip(self.min_workers, self.max_workers)) or \
                min(self.gpus) < 0 or max(self.gpus) < 1 or self.cost(self.min_workers) > self.budget:
            raise ValueError("forecast scaler: need 1 <= min <= max per pool, the minimums within the budget "
                             "and a worker's share of it (gpus) >= 0, one pool's >= 1")
        if self.season_s is not None and not (self.season_s >= self.startup_s + 3 * self.interval_s and
                                              self.season_noise >= 0):
            raise ValueError("forecast scaler: a season must span a startup and three intervals at least "
                             "(and its noise be >= 0)")

    @property
    def headrooms(self) -> tuple[float, float]:
        """Each pool's headroom: (prefill, decode)."""
        h = self.headroom
        return (h, h) if isinstance(h, (int, float)) else (h[0], h[1])

    def describe(self) -> str:
        """The policy in one line (`pdserve up` prints it, `pdserve planner` logs it)."""
        p, d = self.headrooms
        room = f"{100 * p:g}%" if p == d else f"{100 * p:g}% prefill, {100 * d:g}% decode"
        season = f", the load of {self.season_s:g} s ago where it repeats" if self.season_s else ""
        return f"forecast, {self.sizer}, {room} headroom, {self.startup_s:g} s from adding one to serving{season}"

    def cost(self, counts) -> int:
        """What `counts` workers per pool hold of the budget."""
        return sum(n * g for n, g in zip(counts, self.gpus))

    def _window(self) -> list[float]:
        """The rates (one per interval) the forecast is fitted over: the last `history` intervals,
        widened until they hold `rate_requests` arrivals (`_widened`). A rate counted over a few
        seconds of a trickle is mostly noise: two users sending documents that take 16 s each
        arrive in pairs every 16 s, and 10 s of intervals see none of them as often as two — a
        planner that believed those zeros drained a worker each time and took it back. But the
        newest intervals without an arrival, against the window before them, may be beyond chance
        (`_surprise`): then the traffic has stopped, and the window is those intervals. After 10
        arrivals that takes about 8 of their mean gaps; after a fleet's minute, one empty interval."""
        seen = list(self.arrivals)
        quiet = next((i for i, (n, _) in enumerate(reversed(seen)) if n > 0), len(seen))
        if 0 < quiet < len(seen):
            before = self._widened(seen[:len(seen) - quiet])
            if _surprise(0.0, sum(dt for _, dt in seen[len(seen) - quiet:]), sum(n for n, _ in before),
                         sum(dt for _, dt in before)) > self.surprise:
                return [0.0] * quiet
        return [n / dt for n, dt in self._widened(seen)]

    def _widened(self, seen: list[tuple[float, float]]) -> list[tuple[float, float]]:
        """The last `history` of `seen`, and earlier ones until they hold `rate_requests` arrivals —
        but not across a change beyond chance (a trickle after a busy hour is not widened into it)."""
        came, took, k = 0.0, 0.0, 0
        for n, dt in reversed(seen):
            if k >= self.history and (came >= self.rate_requests or
                                      (came > 0 and _surprise(came, took, n, dt) > self.surprise)):
                break
            came, took, k = came + n, took + dt, k + 1
        return seen[len(seen) - k:]

    def forecast(self) -> float:
        """The most requests per second expected before a worker added now could serve: the
        least-squares line through the window's rates (`_window`: the last `history` intervals, as
        a rule), at its highest from the next interval to `startup_s` + one interval ahead (a
        worker removed now is missing all that time; one added now helps only at its end), never
        below zero. The slope is used only where it stands out of the noise (beyond two standard
        errors, with at least Poisson noise: a rate counted over an interval varies by
        √(rate ÷ interval)); otherwise the forecast is the mean. Extrapolating a slope fitted to
        noise is what makes a predictive planner oscillate. A falling line is read at the next
        interval's start, where a worker removed now is first missed; a rising one a startup and an
        interval past the last observed. With `curvature`, raised where the load bends upwards
        and lowered where it bends down (`_bend`): the pools then shrink to the bend's forecast, not
        below it, and a rise towards its peak is not carried past it. Sets `falling`:
        the pools may shrink without waiting (`down_after_falling`)."""
        ys, was_falling = self._window(), self.falling
        if len(ys) < 2:
            self.falling = False
            return ys[-1] if ys else 0.0
        n = len(ys)
        mx, my = (n - 1) / 2, sum(ys) / n
        sxx = sum((i - mx) ** 2 for i in range(n))
        slope = sum((i - mx) * (y - my) for i, y in enumerate(ys)) / sxx
        resid = sum((y - my - slope * (i - mx)) ** 2 for i, y in enumerate(ys)) / (n - 2) if n > 2 else 0.0
        poisson = my / self.interval_s
        se = math.sqrt(max(resid, poisson) / sxx)  # the slope's standard error
        # a decline, not a step down or a dip: 4 intervals or more, on the line within the noise; once
        # seen, it holds while the slope does (a decline that levels off towards a turn is no line)
        self.falling = n >= 4 and (resid <= 2 * poisson or was_falling) and slope < -self.FALL_Z * se
        if abs(slope) < 2 * se:
            slope = 0.0
        seasonal = self._seasonal(n if any(y == 0 for y in ys) else max(n, 2 * self.history))
        if seasonal is not None:
            return seasonal
        ahead = (self.startup_s + self.interval_s) / self.interval_s  # intervals past the last observed one
        line = max(0.0, my + slope * (n - 1 - mx + (ahead if slope > 0 else 0.5)))
        if not self.curvature or any(y == 0 for y in ys):  # (the traffic stopped: nothing turns up)
            return line
        longer = [k / dt for k, dt in list(self.arrivals)[-2 * self.history:]]
        bend = self._bend(longer if len(longer) > n else ys, ahead)
        if bend is None:
            return line
        up, rate = bend
        return max(line, rate) if up else min(line, rate)

    def _seasonal(self, k: int) -> float | None:
        """With `season_s`: the most req/s expected from now to a startup and an interval ahead, read off
        the load a season ago (`_rate_then`) and scaled to today's level — the last `k` intervals'
        arrivals (the forecast's window, or 2·`history` where that is longer) against what the same
        intervals had then — where that scaled
        shape explains those intervals: their squared misses within 3× what Poisson noise, the
        smoothing of the season's rates and `season_noise` (a day's shape strays from yesterday's by a
        few percent) would give, and no trend in the misses beyond DRIFT_Z standard errors (today's
        swing running ahead of or behind yesterday's). Else None: no whole season seen yet, none
        arrived then, or today's shape is another (a step, a surge, a quiet, a shifted swing), which
        the line and the bend follow.

        A line, even bent, sees a turn only once the rates bend beyond their noise: on the planning
        study's daily swing the fleet it sized fell 7–9% short of the load for 4 minutes after the
        trough (forecast_replay.py), and both pools' headroom paid for that all day."""
        if self.season_s is None or self._last is None or k < 2 or len(self.seen) < k:
            return None
        recent, w = self.seen[-k:], self.interval_s
        if self.seen[0][0] > recent[0][0] - self.season_s - self.SMOOTH / 2 * w:
            return None  # not a whole season (and the smoothing's reach) seen before the window
        then = [(b - a) * self._rate_then((a + b) / 2) for a, b, _ in recent]
        if not sum(then) > 0:
            return None
        level = sum(n for *_, n in recent) / sum(then)
        miss, drift, drift_var = 0.0, 0.0, 0.0
        for i, ((_, _, n), x) in enumerate(zip(recent, then)):
            e = level * x
            if e <= 0:
                if n > 0:
                    return None  # arrivals where there were none a season ago
                continue
            var = e * (1 + level / self.SMOOTH)  # Poisson now, and then (a rate over SMOOTH intervals, ×level²)
            miss += (n - e) ** 2 / (var + (self.season_noise * e) ** 2)
            drift += (i - (k - 1) / 2) * (n - e)
            drift_var += (i - (k - 1) / 2) ** 2 * var
        if miss > 3 * (k - 1) or abs(drift) > self.DRIFT_Z * math.sqrt(drift_var):
            return None
        now, span = self._last[0], self.startup_s + self.interval_s
        return level * max(self._rate_then(now + span * q / 20) for q in range(21))

    def _rate_then(self, t: float) -> float:
        """The arrival rate a season before `t`: arrivals seen over the SMOOTH intervals about that
        moment (an interval's spread evenly over it), per second."""
        a, b = (t - self.season_s + f * self.SMOOTH / 2 * self.interval_s for f in (-1, 1))
        came = 0.0
        for start, end, n in self.seen[bisect.bisect_right(self.seen, a, key=lambda x: x[1]):]:
            if start >= b:
                break
            came += n * (min(end, b) - max(start, a)) / (end - start)
        return came / (b - a)

    def _remember(self, start: float, end: float, n: int) -> None:
        """With `season_s`: an interval's arrivals, kept for a season and a window (`_seasonal`)."""
        self.seen.append((start, end, n))
        keep = end - self.season_s - (max(self.max_history, 2 * self.history) + self.SMOOTH) * self.interval_s
        if self.seen[0][1] < keep - 10 * self.interval_s:  # trimmed now and then, not every interval
            del self.seen[:bisect.bisect_left(self.seen, keep, key=lambda x: x[1])]

    def _bend(self, ys: list[float], ahead: float) -> tuple[bool, float] | None:
        """With `curvature`: where the rates of the last 2·`history` intervals bend beyond the noise
        (a parabola's curvature beyond 3 standard errors) and the parabola explains them (its
        residuals within twice the noise: a step in the load is no parabola), (whether it bends
        upwards, a rate from it); else None. Bending up, its rate `ahead` intervals past the last
        one, which only ever raises the line's forecast: a load that levels off at its trough is
        seen to turn up before a line through the trough shows a slope, and a worker added then
        serves when the load comes. Bending down, its highest from the next interval to `ahead`
        (its top, where that lies ahead), which only ever lowers the line's: a line through a rise
        that levels off towards its peak carries it past the peak (on the planning study's swing,
        3-5% more workers than the top needs, for ten minutes). Over 5 intervals the bend of a
        daily swing is lost in the noise; over 10 it is not."""
        n = len(ys)
        if n < 6:
            return None
        xs = [i - (n - 1) / 2 for i in range(n)]
        x2 = [x * x for x in xs]
        m2 = sum(x2) / n
        q = [v - m2 for v in x2]  # x² less its mean: orthogonal to 1 and x over a centred window
        sqq, sxx = sum(v * v for v in q), sum(x * x for x in xs)
        my = sum(ys) / n
        b = sum(x * y for x, y in zip(xs, ys)) / sxx
        c = sum(v * y for v, y in zip(q, ys)) / sqq
        resid = sum((y - my - b * x - c * v) ** 2 for x, y, v in zip(xs, ys, q)) / (n - 3)
        poisson = my / self.interval_s
        if resid > 2 * poisson or abs(c) <= self.BEND_Z * math.sqrt(max(resid, poisson) / sqq):
            return None

        def at(x: float) -> float:
            return max(0.0, my + b * x + c * (x * x - m2))

        if c > 0:
            return True, at(xs[-1] + ahead)
        near, far, top = xs[-1] + 0.5, xs[-1] + ahead, -b / (2 * c)
        return False, at(min(max(top, near), far))

    def targets_for(self, now: float, arrived: int, waiting: tuple[int, int], have: list[int], leaving: int,
                    budget: int, load: Load | None = None,
                    decode_seen: tuple[float, float] | None = None) -> tuple[int, int]:
        """`targets` for a fleet that stands at `have` workers per pool (changed outside or not),
        with workers still draining that hold `leaving` of `budget` until they are gone.
        `decode_seen`: (the interval's mean time per token, the mean sequences per decode worker),
        from which the profile's decode step is corrected (`observe_decode`)."""
        self.current = list(have)
        self.budget = max(self.cost(self.min_workers), budget - leaving)
        if decode_seen is not None:
            self.observe_decode(*decode_seen)
        return self.targets(now, arrived, waiting, load)

    def observe_decode(self, per_token_s: float | None, batch: float) -> None:
        """Correct the profile's decode step by what a live stack shows, as Dynamo's planner corrects
        its profile: the interval's mean time per token against the profile's step at the batch the
        decode workers held. A moving average (half from each interval), within ×¼..×4; nothing for
        an interval without decoding or before the mix is known. Prefill needs none: the gateway
        measures prefill seconds themselves."""
        step = getattr(self.sizer, "step", None)
        if step is None or self.mix is None or per_token_s is None or not per_token_s > 0 or batch < 1:
            return
        seen = min(4.0, max(0.25, per_token_s / step(batch, self.mix)))
        self.decode_factor = 0.5 * self.decode_factor + 0.5 * seen

    def _observe_mix(self, load: Load | None) -> None:
        if load is None:
            return
        if self._last_load is not None:
            self.loads.append(load - self._last_load)
            while len(self.loads) > self.history:
                self.loads.popleft()
            window = Load()  # the latest intervals that hold `mix_requests` between them (or all of them)
            for past in reversed(self.loads):
                window += past
                if window.finished >= self.mix_requests and window.prefilled >= self.mix_requests:
                    break
            self.mix = Mix.of(window) or self.mix
        self._last_load = load

    def _least(self, now: float) -> list[int]:
        """Each pool's least count now: its minimum, or the floor's count where that is more (within
        its maximum)."""
        if self.floor is None:
            return list(self.min_workers)
        return [min(max(lo, f), hi) for lo, f, hi in zip(self.min_workers, self.floor(now), self.max_workers)]

    def targets(self, now: float, arrived: int, waiting: tuple[int, int] = (0, 0),
                load: Load | None = None) -> tuple[int, int]:
        """Workers wanted per pool, from the arrivals so far, the jobs waiting for each pool now
        and the work finished so far (`load`: running totals; the profile sizer needs it)."""
        if self._last is not None and now > self._last[0]:
            self.arrivals.append((arrived - self._last[1], now - self._last[0]))
            if self.season_s is not None:
                self._remember(self._last[0], now, arrived - self._last[1])
            while len(self.arrivals) > self.max_history:
                self.arrivals.popleft()
        self._last = (now, arrived)
        self._observe_mix(load)
        least = self._least(now)
        if not self.arrivals:  # nothing observed yet: keep the fleet as it is (or as the floor wants it)
            self.current = [max(n, lo) for n, lo in zip(self.current or self.min_workers, least)]
            return tuple(self.current)
        rate = self.forecast()
        want = [rate * (1 + h) + max(0.0, q - self.queue_per_worker * n) / self.interval_s
                for h, q, n in zip(self.headrooms, waiting, self.current)]
        mix = self.mix if self.mix is None else replace(self.mix, decode_factor=self.decode_factor)
        need = [self.sizer.workers(i, w, mix) for i, w in enumerate(want)]
        need = [self.current[i] if n is None else n for i, n in enumerate(need)]  # no mix known yet: as it is
        need = [min(max(n, lo), hi) for n, lo, hi in zip(need, least, self.max_workers)]
        if self.cost(need) > self.budget:  # each pool its share of the budget
            scale = self.budget / self.cost(need)
            need = [max(lo, math.floor(n * scale)) for n, lo in zip(need, self.min_workers)]
        for i, n in enumerate(need):
            if n >= self.current[i]:
                self.current[i] = n
                self.lower[i].clear()
            else:
                self.lower[i].append(n)
                if len(self.lower[i]) >= (self.down_after_falling if self.falling else self.down_after):
                    self.current[i] = max(self.lower[i])
                    self.lower[i].clear()
        while self.cost(self.current) > self.budget:  # a pool held up by hysteresis yields to the one growing
            i = max((k for k in (0, 1) if self.current[k] > self.min_workers[k] and self.gpus[k]),
                    key=lambda k: (self.current[k] - need[k]) * self.gpus[k])
            self.current[i] -= 1
        return tuple(self.current)
