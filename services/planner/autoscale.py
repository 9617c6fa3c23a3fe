"""The live planner behind `pdserve up --autoscale`: watch the gateway's metrics, add or remove
local prefill / decode worker processes.

    every interval:  /metrics → Observation (this interval's TTFT and ITL p90 from histogram deltas,
                     queue depths) → Autoscaler.step → spawn or drain through an Actuator

Policy (Autoscaler, pure: tests drive it with simulated observations):
  * a pool is *hot* when its SLO is missed (prefill: TTFT p90; decode: ITL p90) or work queues up
    for it; *cold* when its metric is below `low_water` × SLO and nothing waits — a band between
    the two where nothing happens (hysteresis: a steady load never flips between two counts)
  * add one worker after `up_after` hot intervals in a row; remove one after `down_after` cold
    ones (much longer: adding is cheap to undo, removing a worker under load is not); `cooldown`
    intervals after any change to a pool before the next, so the change's effect is seen first
  * no traffic at all is cold for both pools: they shrink to their minimum
  * never beyond the budget — draining workers count until they have exited; a worker counts 1, or
    on Kubernetes the GPUs its pod requests (`gpus`: a TP4 prefill pod 4, a TP8 decode pod 8)
  * removal drains: SIGTERM (the worker stops taking jobs, finishes what it holds, exits); the
    worker is out of the count of capacity at once and out of the budget when it has exited

`--policy forecast` (ForecastAutoscaler) sizes each pool instead from the arrival rate forecast a
startup ahead and what one worker carries (services/planner/forecast.py, as `pdserve planner` does
on Kubernetes), with the same bounds, budget and draining.
"""

from __future__ import annotations

import logging
import re
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from services.planner.forecast import Capacity, ForecastScaler, ProfileSizer, headroom_arg
from shared.sim.cost import load_profile
from shared.sim.workload import Load
from shared.telemetry.names import (E2E, GENAI_TPOT, GENERATION_TOKENS, ITL, PREFILL_SECONDS, PROMPT_TOKENS,
                                    REQUESTS_RUNNING, REQUESTS_TOTAL, REQUESTS_WAITING, TTFT)

log = logging.getLogger("pdserve.autoscale")

KINDS = ("prefill", "decode")


@dataclass(frozen=True)
class AutoscaleConfig:
    min_prefill: int = 1
    max_prefill: int = 4
    min_decode: int = 1
    max_decode: int = 4
    budget: int = 6  # prefill + decode processes at most (each weighed by `gpus`), draining ones included
    gpus: tuple[int, int] = (1, 1)  # what a worker of each pool holds of the budget (GPUs; or 1: a process)
    interval_s: float = 5.0
    up_after: int = 2  # hot intervals in a row before adding a worker
    down_after: int = 6  # cold intervals in a row before removing one
    cooldown: int = 2  # intervals after a change to a pool before it may change again
    slo_ttft_p90_s: float = 2.0
    slo_itl_p90_s: float = 0.25
    low_water: float = 0.4  # cold: the metric below this fraction of its SLO
    queue_per_worker: float = 2.0  # hot: more than this many requests waiting per worker of the pool
    colocated: bool = False  # one pool of engine workers (counted as decode; judged by TTFT and ITL)

    def __post_init__(self) -> None:
        if not 0 <= self.min_prefill <= self.max_prefill or not 0 <= self.min_decode <= self.max_decode:
            raise ValueError("autoscale: need 0 <= min <= max for each pool")
        if min(self.gpus) < 0 or max(self.gpus) < 1:
            raise ValueError(f"autoscale: a worker's share of the budget must be >= 0, one pool's >= 1: {self.gpus}")
        least = self.cost((self.min_prefill, self.min_decode))
        if least > self.budget:
            held = "" if self.gpus == (1, 1) else f" workers, {least} GPUs"
            raise ValueError(f"autoscale: the minimums ({self.min_prefill} + {self.min_decode}{held}) exceed the "
                             f"budget {self.budget}")
        if self.interval_s <= 0 or self.up_after < 1 or self.down_after <= self.up_after or self.cooldown < 0:
            raise ValueError("autoscale: need interval > 0, up_after >= 1, down_after > up_after, cooldown >= 0")
        if not 0 < self.low_water < 1 or self.slo_ttft_p90_s <= 0 or self.slo_itl_p90_s <= 0:
            raise ValueError("autoscale: need 0 < low_water < 1 and positive SLOs")

    def cost(self, counts) -> int:
        """What `counts` workers per pool (prefill, decode) hold of the budget."""
        return sum(n * g for n, g in zip(counts, self.gpus))

    def describe(self, workers: str = "processes") -> str:
        pools = (f"engine workers {self.min_decode}–{self.max_decode}" if self.colocated
                 else f"prefill {self.min_prefill}–{self.max_prefill}, decode {self.min_decode}–{self.max_decode}")
        budget = f"{self.budget} {workers}" if self.gpus == (1, 1) else \
            f"{self.budget} GPUs (a prefill worker {self.gpus[0]}, a decode worker {self.gpus[1]})"
        return (f"autoscaling: {pools}, {budget} at most, a decision every {self.interval_s:g} s "
                f"(SLOs: TTFT p90 {self.slo_ttft_p90_s * 1e3:g} ms, ITL p90 {self.slo_itl_p90_s * 1e3:g} ms)")

    def bounds(self, kind: str) -> tuple[int, int]:
        return (self.min_prefill, self.max_prefill) if kind == "prefill" else (self.min_decode, self.max_decode)


@dataclass(frozen=True)
class Observation:
    """One interval of the system, as the gateway's metrics show it."""

    requests: int  # requests that arrived in the interval (answered + the change in those in flight)
    ttft_p90_s: float | None  # None: no first token in the interval
    itl_p90_s: float | None
    prefill_waiting: float  # requests dispatched with no first token yet
    decode_waiting: float  # decode jobs waiting for a worker
    finished: Load = field(default_factory=Load)  # work finished in the interval (the profile sizer's mix)
    tpot_mean_s: float | None = None  # the mean time per output token of the requests finished in it
    decode_batch: float = 0.0  # sequences per decode worker at the scrape (mean over the workers)
    load: dict[str, float] = field(default_factory=dict)  # each worker's requests (running + waiting), by instance


class Actuator(Protocol):
    def spawn(self, kind: str) -> str: ...  # start a worker; its name

    # SIGTERM: finish and exit; `load` (each worker's requests, by instance) steers an actuator that
    # cannot name the one it removes (Kubernetes picks the pod)
    def drain(self, kind: str, name: str, load: dict[str, float] | None = None) -> None: ...

    def exited(self, name: str) -> bool: ...


@dataclass
class PoolState:
    active: list[str] = field(default_factory=list)
    draining: list[str] = field(default_factory=list)
    hot: int = 0
    cold: int = 0
    since_change: int = 1 << 30


@dataclass(frozen=True)
class Decision:
    interval: int
    kind: str
    action: str  # "add" | "drain"
    name: str
    reason: str


class Workers:
    """The local pools' processes, as a policy changes them: the active ones per pool, the drained
    ones until they have exited, and every add and drain made through the actuator."""

    def __init__(self, actuator: Actuator, initial: dict[str, list[str]], gpus: tuple[int, int] = (1, 1)):
        self.actuator = actuator
        self.gpus = dict(zip(KINDS, gpus))  # what a worker of each pool holds of the budget
        self.pools = {kind: PoolState(active=list(initial.get(kind, []))) for kind in KINDS}
        self.interval = 0
        self.decisions: list[Decision] = []

    def count(self, kind: str) -> int:
        return len(self.pools[kind].active)

    @property
    def processes(self) -> int:
        return sum(len(p.active) + len(p.draining) for p in self.pools.values())

    @property
    def used(self) -> int:
        """What the workers hold of the budget, draining ones included."""
        return sum((len(p.active) + len(p.draining)) * self.gpus[k] for k, p in self.pools.items())

    def _next_interval(self) -> None:
        self.interval += 1
        for pool in self.pools.values():  # drained workers that have exited leave the budget
            pool.draining = [n for n in pool.draining if not self.actuator.exited(n)]
            pool.since_change += 1

    def _add(self, kind: str, reason: str) -> Decision:
        pool = self.pools[kind]
        name = self.actuator.spawn(kind)
        pool.active.append(name)
        pool.hot = pool.cold = 0
        pool.since_change = 0
        log.info("autoscale: + %s %s (%s); now %d", kind, name, reason, len(pool.active))
        return Decision(self.interval, kind, "add", name, reason)

    def _drain(self, kind: str, reason: str, load: dict[str, float]) -> Decision:
        """Drain the pool's least loaded worker by the last scrape (`load`: its running and waiting
        requests): the least to finish, and the fewest streams that might outlast the drain's grace and
        migrate; of equals (or unseen: on Kubernetes the names are slots) the newest."""
        pool = self.pools[kind]
        i = min(range(len(pool.active)), key=lambda i: (load.get(pool.active[i], 0.0), -i))
        name = pool.active.pop(i)
        if name in load:
            reason += f"; it holds {load[name]:g} requests"
        self.actuator.drain(kind, name, load)
        pool.draining.append(name)
        pool.hot = pool.cold = 0
        pool.since_change = 0
        log.info("autoscale: - %s %s draining (%s); now %d", kind, name, reason, len(pool.active))
        return Decision(self.interval, kind, "drain", name, reason)


class Autoscaler(Workers):
    """The reactive policy: one worker at a time, when a pool's SLO is missed or its queue grows."""

    def __init__(self, config: AutoscaleConfig, actuator: Actuator, initial: dict[str, list[str]]):
        super().__init__(actuator, initial, config.gpus)
        self.config = config

    def step(self, obs: Observation, now: float = 0.0) -> list[Decision]:
        self._next_interval()
        cfg = self.config
        ttft = (obs.ttft_p90_s or 0.0) / cfg.slo_ttft_p90_s
        itl = (obs.itl_p90_s or 0.0) / cfg.slo_itl_p90_s
        if cfg.colocated:  # the engine workers do both: the worse of the two, every request waiting
            pressure = {"prefill": self._pressure("prefill", 0.0, 0.0),
                        "decode": self._pressure("decode", max(ttft, itl), obs.prefill_waiting + obs.decode_waiting)}
        else:
            pressure = {"prefill": self._pressure("prefill", ttft, obs.prefill_waiting),
                        "decode": self._pressure("decode", itl, obs.decode_waiting)}
        made = []
        # the pool further over its SLO gets a free budget slot first
        for kind in sorted(KINDS, key=lambda k: -pressure[k]):
            pool, (lo, hi) = self.pools[kind], self.config.bounds(kind)
            if pool.since_change <= self.config.cooldown:
                continue
            n = len(pool.active)
            if n < lo or (pool.hot >= self.config.up_after and n < hi):
                if self.used + self.gpus[kind] > self.config.budget:
                    continue  # at the budget (maybe still draining): wait
                made.append(self._add(kind, f"hot {pool.hot} intervals (pressure {pressure[kind]:.2f})"
                                      if n >= lo else "below its minimum"))
            elif pool.cold >= self.config.down_after and n > lo:
                made.append(self._drain(kind, f"cold {pool.cold} intervals", obs.load))
        self.decisions += made
        return made

    def _pressure(self, kind: str, over: float, waiting: float) -> float:
        """Updates the pool's hot/cold streaks from `over` (its p90 / its SLO, 0 with no samples);
        returns how far over it is, queue included (for priority). An interval with no arrivals is
        not cold by that alone: streams that began before it still run, and their ITL may miss the
        SLO. No traffic at all has no samples: over 0, cold."""
        pool, cfg = self.pools[kind], self.config
        n = max(1, len(pool.active))
        queued = waiting > cfg.queue_per_worker * n
        hot = over > 1.0 or queued
        cold = over < cfg.low_water and waiting == 0
        pool.hot = pool.hot + 1 if hot else 0
        pool.cold = pool.cold + 1 if cold else 0
        return over + (waiting / n if queued else 0.0)


class ForecastAutoscaler(Workers):
    """The forecast policy (`--policy forecast`) on local workers: each interval the ForecastScaler
    (services/planner/forecast.py, as `pdserve planner` uses on Kubernetes) names each pool's
    count, and workers are drained down to it, the least loaded first, or started up to it. Drained workers
    count against the budget until they have exited, so a pool that grows while another drains
    may get its workers an interval later."""

    def __init__(self, scaler: ForecastScaler, actuator: Actuator, initial: dict[str, list[str]]):
        super().__init__(actuator, initial, scaler.gpus)
        self.scaler, self.budget = scaler, scaler.budget
        self.arrived = 0  # requests seen by the gateway since the policy started
        self.load = Load()  # work finished since then

    def step(self, obs: Observation, now: float) -> list[Decision]:
        self._next_interval()
        have = [self.count(k) for k in KINDS]
        self.arrived += obs.requests
        self.load += obs.finished
        targets = self.scaler.targets_for(now, self.arrived, (round(obs.prefill_waiting), round(obs.decode_waiting)),
                                          have, self.used - self.scaler.cost(have), self.budget, self.load,
                                          (obs.tpot_mean_s, obs.decode_batch))
        reason = f"forecast {self.scaler.forecast():.3g} req/s"
        made = []
        for kind, n in zip(KINDS, targets):  # drains first: a pool that grows may need their budget
            while self.count(kind) > n:
                made.append(self._drain(kind, reason, obs.load))
        for kind, n in zip(KINDS, targets):
            while self.count(kind) < n and self.used + self.gpus[kind] <= self.budget:
                made.append(self._add(kind, reason))
        self.decisions += made
        return made


# ------------------------------------------------------------------------------- live metrics

_SAMPLE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)')


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    out = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m or line.startswith("#"):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m["labels"] or ""))
        try:
            out.append((m["name"], labels, float(m["value"])))
        except ValueError:
            continue
    return out


def _buckets(samples, name: str) -> dict[float, float]:
    """Cumulative bucket counts of a histogram, summed over label sets, by upper bound."""
    out: dict[float, float] = {}
    for n, labels, v in samples:
        if n == f"{name}_bucket":
            le = float(labels["le"]) if labels.get("le") not in (None, "+Inf") else float("inf")
            out[le] = out.get(le, 0.0) + v
    return out


def histogram_p90(now: dict[float, float], before: dict[float, float]) -> float | None:
    """p90 of the observations between two scrapes (the upper bound of the bucket holding it)."""
    bounds = sorted(now)
    delta = [now[b] - before.get(b, 0.0) for b in bounds]
    if not delta or delta[-1] <= 0:
        return None
    target = 0.9 * delta[-1]
    for b, c in zip(bounds, delta):
        if c >= target:
            return b if b != float("inf") else bounds[-2] if len(bounds) > 1 else None
    return None


def _finished(samples) -> Load:
    """A gateway's totals of finished work: requests (E2E observations), their tokens and prefill seconds."""
    total = {name: sum(v for n, _, v in samples if n == name)
             for name in (f"{E2E}_count", PROMPT_TOKENS, GENERATION_TOKENS, PREFILL_SECONDS)}
    done = total[f"{E2E}_count"]
    return Load(finished=done, output_tokens=total[GENERATION_TOKENS], prefilled=done,
                prompt_tokens=total[PROMPT_TOKENS], prefill_s=total[PREFILL_SECONDS])


class _Totals(NamedTuple):
    """One gateway's running totals at a scrape (an interval is the difference of two)."""

    arrived: float  # answered (counted by outcome, at the end) + still in flight at this gateway
    answered: float  # its requests counter: one that went back is a restarted gateway
    ttft: dict[float, float]  # cumulative histogram buckets
    itl: dict[float, float]
    finished: Load
    tpot: tuple[float, float]  # (sum, count)


class MetricsWatcher:
    """Scrapes the gateways' /metrics; each `observe()` describes the time since the previous one.

    `base_url` is one gateway, or a callable giving the gateways' URLs now (on Kubernetes every
    replica's pod: behind the Service each scrape would reach a different one). Counters and
    histograms are per gateway, so their interval deltas are taken per gateway and summed (a gateway
    seen for the first time, or restarted, only sets its baseline); the workers' gauges, which every
    gateway repeats, are counted once per label set."""

    def __init__(self, base_url: str | Callable[[], list[str]], fetch: Callable[[str], str] | None = None):
        self.urls = base_url if callable(base_url) else (lambda: [base_url])
        self.fetch = fetch or (lambda url: urllib.request.urlopen(url, timeout=5).read().decode())
        self._prev: dict[str, _Totals] = {}

    def observe(self) -> Observation:
        pages, failed = {}, {}
        for url in self.urls():
            try:
                pages[url] = parse_prometheus(self.fetch(f"{url.rstrip('/')}/metrics"))
            except OSError as exc:  # one gateway restarting: the others still speak for the interval
                failed[url] = exc
        if failed and not pages:
            raise OSError("; ".join(f"{url}: {exc}" for url, exc in failed.items()))
        requests, ttft, itl, gauges, running, finished, tpot = 0.0, {}, {}, {}, {}, Load(), [0.0, 0.0]
        for url, samples in pages.items():
            # arrivals, not answers alone: those lag the arrivals by a request's duration, and after
            # traffic stops they still come for that long — load that is no longer there
            answered = sum(v for n, _, v in samples if n == REQUESTS_TOTAL)
            in_flight = sum(v for n, labels, v in samples
                            if n == REQUESTS_RUNNING and labels.get("service") == "gateway")
            tpot_total = tuple(sum(v for n, _, v in samples if n == f"{GENAI_TPOT}_{p}") for p in ("sum", "count"))
            now = _Totals(answered + in_flight, answered, _buckets(samples, TTFT), _buckets(samples, ITL),
                          _finished(samples), tpot_total)
            before = self._prev.get(url)
            self._prev[url] = now
            for n, labels, v in samples:
                if n in (REQUESTS_WAITING, REQUESTS_RUNNING):
                    (gauges if n == REQUESTS_WAITING else running)[tuple(sorted(labels.items()))] = v
            if before is None or now.answered < before.answered:  # new, or restarted
                continue
            requests += now.arrived - before.arrived
            finished += now.finished - before.finished
            tpot = [tpot[0] + now.tpot[0] - before.tpot[0], tpot[1] + now.tpot[1] - before.tpot[1]]
            for acc, cur, old in ((ttft, now.ttft, before.ttft), (itl, now.itl, before.itl)):
                for le, c in cur.items():
                    acc[le] = acc.get(le, 0.0) + c - old.get(le, 0.0)
        self._prev = {url: v for url, v in self._prev.items() if url in pages or url in failed}
        waiting = {s: sum(v for labels, v in gauges.items() if dict(labels).get("service") == s)
                   for s in ("gateway", "decode")}
        decoding = [v for labels, v in running.items() if dict(labels).get("service") == "decode"]
        load: dict[str, float] = {}
        for labels, v in [*running.items(), *gauges.items()]:
            service, instance = dict(labels).get("service"), dict(labels).get("instance")
            if service in ("prefill", "decode", "colocated") and instance:
                load[instance] = load.get(instance, 0.0) + v
        return Observation(requests=int(requests), ttft_p90_s=histogram_p90(ttft, {}),
                           itl_p90_s=histogram_p90(itl, {}), prefill_waiting=waiting["gateway"],
                           decode_waiting=waiting["decode"], finished=finished,
                           tpot_mean_s=tpot[0] / tpot[1] if tpot[1] > 0 else None,
                           decode_batch=sum(decoding) / len(decoding) if decoding else 0.0, load=load)


class LiveAutoscaler:
    """The loop, driven by `tick()` from `pdserve up`'s supervision loop (the same thread that
    restarts and retires children, so the two never race): every `interval_s`, observe, decide, act."""

    def __init__(self, config: AutoscaleConfig, base_url: str, actuator: Actuator, initial: dict[str, list[str]],
                 watcher: MetricsWatcher | None = None, clock: Callable[[], float] = time.monotonic,
                 policy: Autoscaler | ForecastAutoscaler | None = None):
        self.config, self.clock = config, clock
        self.autoscaler = policy or Autoscaler(config, actuator, initial)
        self.watcher = watcher or MetricsWatcher(base_url)
        self._next: float | None = None  # None: the baseline scrape is still to take

    def due(self) -> bool:
        return self._next is None or self.clock() >= self._next

    def tick(self) -> list[Decision]:
        now = self.clock()
        if self._next is not None and now < self._next:
            return []
        baseline, self._next = self._next is None, now + self.config.interval_s
        try:
            obs = self.watcher.observe()
        except OSError as exc:  # the gateway restarting: skip this interval, decide nothing blind
            log.warning("autoscale: scrape failed (%s); skipping an interval", exc)
            return []
        return [] if baseline else self.autoscaler.step(obs, now)


# ------------------------------------------------------------------------------ `pdserve up` glue


def add_autoscale_args(p) -> None:
    """`pdserve up --autoscale …` (the pools start at --prefill / --decode workers)."""
    import os

    cores = os.cpu_count() or 2
    g = p.add_argument_group("autoscaling (pdserve up --autoscale)")
    g.add_argument("--autoscale", action="store_true",
                   help="add and remove local prefill / decode workers from the gateway's metrics")
    add_limit_args(g, max_per_pool=max(1, cores // 2), what="processes")
    add_policy_args(g, what="worker", startup_s=10.0)


def add_policy_args(g, what: str, startup_s: float) -> None:
    """The policy: reactive (the default) or forecast, and the forecast's inputs."""
    g.add_argument("--policy", choices=("reactive", "forecast"), default="reactive",
                   help=f"reactive: one {what} at a time when an SLO is missed (a few {what}s); forecast: each pool "
                        "sized for the forecast load (a fleet)")
    g.add_argument("--capacity", default=None, metavar="PREFILL_RPS,DECODE_RPS",
                   help=f"forecast: req/s one {what} of each pool carries within the SLOs (pdserve plan prints it "
                        "for the load it searched); default: each pool sized from --profile and the mix of the "
                        "requests that finished lately")
    g.add_argument("--profile", dest="sizer_profile", default=None, metavar="FILE",
                   help=f"forecast: the engine profile of one {what} (pdserve profile; default: the one shipped "
                        "for this machine)")
    g.add_argument("--startup-s", type=float, default=startup_s,
                   help=f"forecast: seconds from adding a {what} until it serves (how far ahead to forecast)")
    g.add_argument("--headroom", type=headroom_arg, default=0.1, metavar="H | PREFILL,DECODE",
                   help="forecast: capacity above the forecast, for both pools or each its own")
    g.add_argument("--season-s", type=float, default=None, metavar="SECONDS",
                   help="forecast: the load's period (86400: a day). Once a whole one is seen, the forecast is what "
                        "the load did a period ago at today's level, where that shape explains the latest intervals "
                        "(the turns of a daily swing foreseen, not seen late); kept in memory: a restart sees it anew")
    g.add_argument("--schedule", default=None, metavar="PLAN.json",
                   help=f"forecast: a `pdserve plan --forecast ... --json` result: each pool at least the {what}s "
                        "its schedule has for now (clock times: in the plan's --timezone, else this machine's local "
                        "time), in place a startup ahead; the forecast adds what the plan did not foresee")


def forecast_scaler(args, config: AutoscaleConfig, command: str, kv_path: str = "shm") -> ForecastScaler:
    """The ForecastScaler of `--policy forecast` (a bad flag: one line naming it, no traceback)."""
    if config.colocated:
        raise SystemExit(f"{command}: --policy forecast sizes a prefill and a decode pool; colocated mode has one")
    try:
        if args.capacity:
            sizer = Capacity.parse(args.capacity)
        else:  # the SLO is on ITL p90, a streamed event's gap: the profile's decode fit is per token
            profile = load_profile(args.sizer_profile)
            sizer = ProfileSizer(profile, config.slo_ttft_p90_s, config.slo_itl_p90_s / profile.tokens_per_event,
                                 attainment=0.9, kv_path=kv_path)
        floor = None
        if args.schedule:
            from services.planner.schedule import Schedule

            floor = Schedule.load(args.schedule, config.interval_s).floor
        return ForecastScaler(sizer, interval_s=config.interval_s, startup_s=args.startup_s,
                              headroom=args.headroom, min_workers=(config.min_prefill, config.min_decode),
                              max_workers=(config.max_prefill, config.max_decode), budget=config.budget,
                              gpus=config.gpus, floor=floor, season_s=args.season_s)
    except (ValueError, OSError) as exc:
        raise SystemExit(f"{command}: {exc}") from None


def add_limit_args(g, max_per_pool: int, what: str) -> None:
    """The pools' bounds, the budget, the decision interval and the SLOs: `up --autoscale`'s and
    `pdserve planner`'s (workers or pods)."""
    g.add_argument("--min-prefill", type=int, default=1)
    g.add_argument("--max-prefill", type=int, default=max_per_pool)
    g.add_argument("--min-decode", type=int, default=1)
    g.add_argument("--max-decode", type=int, default=max_per_pool)
    g.add_argument("--budget", type=int, default=None,
                   help=f"prefill + decode {what} at most, draining ones included (default: max-prefill + max-decode)")
    g.add_argument("--autoscale-interval", type=float, default=5.0, help="seconds between decisions")
    g.add_argument("--slo-ttft-p90-ms", type=float, default=None,
                   help="default: 2000 (`pdserve up --plan`: the plan's)")
    g.add_argument("--slo-itl-p90-ms", type=float, default=None, help="default: 250 (`pdserve up --plan`: the plan's)")


def limits_config(args, *, colocated: bool = False, started: tuple[int, int] = (0, 0),
                  gpus: tuple[int, int] = (1, 1)) -> AutoscaleConfig:
    """AutoscaleConfig from `add_limit_args`' arguments; a pool's maximum is at least `started`; a
    worker of each pool holds `gpus` of the budget (the default budget: both pools at their maximum)."""
    if getattr(args, "schedule", None) and args.policy != "forecast":
        raise ValueError("--schedule is a floor under the forecast policy: give --policy forecast")
    if getattr(args, "season_s", None) and args.policy != "forecast":
        raise ValueError("--season-s is the forecast policy's: give --policy forecast")
    max_prefill = 0 if colocated else max(args.max_prefill, started[0])
    max_decode = max(args.max_decode, started[1])
    ttft_ms, itl_ms = (default if given is None else given for given, default in
                       ((args.slo_ttft_p90_ms, 2000.0), (args.slo_itl_p90_ms, 250.0)))
    return AutoscaleConfig(min_prefill=0 if colocated else args.min_prefill, max_prefill=max_prefill,
                           min_decode=args.min_decode, max_decode=max_decode,
                           budget=args.budget or max_prefill * gpus[0] + max_decode * gpus[1], gpus=gpus,
                           colocated=colocated,
                           interval_s=args.autoscale_interval, slo_ttft_p90_s=ttft_ms / 1e3, slo_itl_p90_s=itl_ms / 1e3)


def autoscale_config(args) -> AutoscaleConfig:
    """From `up`'s resolved arguments. Colocated mode has one pool (the engine workers, counted as
    decode, judged by TTFT and ITL both); a pool's maximum is at least what `up` starts."""
    return limits_config(args, colocated=args.mode == "colocated", started=(args.prefill, args.decode))


def start_autoscaler(config: AutoscaleConfig, forecast: ForecastScaler | None, url: str, actuator: Actuator,
                     initial: dict[str, list[str]]) -> LiveAutoscaler:
    """What `pdserve up --autoscale` makes once the stack is healthy (`forecast`: `--policy
    forecast`'s scaler, checked before the stack started): `initial[kind]` names the workers
    already up; `tick()` it from the supervision loop."""
    policy = None if forecast is None else ForecastAutoscaler(forecast, actuator, initial)
    return LiveAutoscaler(config, url, actuator, initial, policy=policy)
