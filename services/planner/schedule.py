"""`pdserve plan --forecast FILE`: the pools' sizes through a load forecast, planned and verified.

A forecast is a CSV of `time,rate` rows: a time (seconds, or HH:MM[:SS] of a day) and the request
rate from then on, in req/s. Each rate holds until the next row's time; the last one until the first
row's time the next day (clock times), or as long as the row before it (seconds). The requests' mix
comes from `--workload` or `--trace`, as for a plan; a trace keeps its own burstiness, stretched to
each rate.

    1. The busiest period is planned as `pdserve plan` plans (every mode, chunk budget, jobs a
       prefill worker and pool profile it is given): that is the deployment's shape.
    2. Every other rate is planned with that shape fixed, so only the pools' sizes change through
       the day (an idle period: one worker a pool). A busier period never gets fewer workers in a
       pool than a quieter one (each rate is a search of its own, on its own sample).
    3. The schedule: each period's pools serve from its start, so a pool that grows is added
       `--startup-s` before it (the workers load their model); one that shrinks drains from the
       start of the smaller period.
    4. Verified (unless `--no-verify`): the whole horizon simulated in one run, the arrivals
       following the forecast, the pools resized by the schedule, and each period's SLOs read from
       it (its TTFT and TPOT p90s, or with `--slo-attainment` its shares of requests within them).
       The search planned each rate in steady state from an empty system; this run carries the
       queues of one period into the next, and pays for the workers while they load. A period that
       misses gets ~5% more workers in the pool that sets the missed SLO, and the schedule is
       verified again (`--repair` rounds).

The cost is GPU-hours: the periods' GPUs over their lengths, plus the added workers' loading,
against the busiest period's configuration held throughout. `Schedule` reads a plan back on a
live clock: the forecast policy's floor (`--schedule`).
"""

from __future__ import annotations

import bisect
import json
import logging
import math
import time
from dataclasses import dataclass, replace
from datetime import datetime, tzinfo
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import numpy as np

from shared.sim.cluster import Cluster, ClusterConfig
from shared.sim.cost import Profile
from shared.sim.workload import SimRequest, poisson_requests, read_trace

log = logging.getLogger("pdserve.plan")

DAY_S = 86_400.0


@dataclass(frozen=True)
class Period:
    start_s: float
    end_s: float
    rate: float  # req/s

    @property
    def length_s(self) -> float:
        return self.end_s - self.start_s


def _time(text: str) -> tuple[float, bool]:
    """Seconds, and whether it was a clock time (HH:MM[:SS])."""
    if ":" not in text:
        return float(text), False
    parts = text.split(":")
    if len(parts) not in (2, 3) or not all(p.isdigit() for p in parts):
        raise ValueError(f"time {text!r}: want HH:MM or HH:MM:SS")
    h, m, s = (int(p) for p in (*parts, "0")[:3])
    if h > 24 or m > 59 or s > 59 or h * 3600 + m * 60 + s > DAY_S:
        raise ValueError(f"time {text!r} is not within a day")
    return float(h * 3600 + m * 60 + s), True


def read_forecast(path: str | Path) -> tuple[list[Period], bool]:
    """The forecast's periods, and whether its times were clock times of a day (then the last
    period runs to the first row's time the next day)."""
    rows: list[tuple[float, float]] = []
    clock: set[bool] = set()
    first = True
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        header, first = first, False
        fields = [f.strip() for f in line.split(",")]
        try:
            if len(fields) != 2:
                raise ValueError(f"want `time,rate`, got {len(fields)} fields")
            t, is_clock = _time(fields[0])
            rate = float(fields[1])
        except ValueError as exc:
            if header:  # (a first line that is not a row: `time,rate`, say)
                continue
            raise ValueError(f"{path}:{n}: {exc}") from None
        if not (math.isfinite(t) and t >= 0) or not (math.isfinite(rate) and rate >= 0):
            raise ValueError(f"{path}:{n}: the time and the rate must be finite and not negative")
        if rows and t <= rows[-1][0]:
            raise ValueError(f"{path}:{n}: times must increase ({t:g} s after {rows[-1][0]:g} s)")
        rows.append((t, rate))
        clock.add(is_clock)
    if len(clock) > 1:
        raise ValueError(f"{path}: mixes clock times and seconds")
    is_clock = clock == {True}
    if not rows or (len(rows) < 2 and not is_clock):
        raise ValueError(f"{path}: a forecast needs at least two rows (time,rate)")
    if not any(rate > 0 for _, rate in rows):
        raise ValueError(f"{path}: every rate is 0: nothing to plan")
    ends = [t for t, _ in rows[1:]]
    ends.append(rows[0][0] + DAY_S if is_clock else rows[-1][0] + (rows[-1][0] - rows[-2][0]))
    return [Period(t, end, rate) for (t, rate), end in zip(rows, ends)], is_clock


class Warp:
    """Time under a piecewise-constant rate: `expected(t)` arrivals by t, and its inverse, so that a
    process of unit rate (or a trace at its own) is laid on the forecast."""

    def __init__(self, periods: list[Period]):
        self.t0 = periods[0].start_s
        self.starts = [p.start_s - self.t0 for p in periods]
        self.rates = [p.rate for p in periods]
        self.cum = [0.0]
        for p in periods:
            self.cum.append(self.cum[-1] + p.rate * p.length_s)

    @property
    def total(self) -> float:
        return self.cum[-1]

    def time_of(self, u: float) -> float:
        """The time (from the first period's start) by which `u` arrivals are expected."""
        i = min(bisect.bisect_right(self.cum, u) - 1, len(self.rates) - 1)
        while self.rates[i] == 0:  # no arrival inside an idle period: the next busy one's start
            i += 1
        return self.starts[i] + (u - self.cum[i]) / self.rates[i]


class ScheduleScaler:
    """Resizes a simulation's pools by a schedule (cluster.Scaler): at each decision, the most
    workers of a pool any period needs from now until a worker added at the next decision would
    serve — so a pool grows in time for its period, and shrinks once no period near needs it."""

    def __init__(self, starts: list[float], counts: list[tuple[int, int]], startup_s: float, interval_s: float):
        self.starts, self.counts = starts, counts
        self.startup_s, self.interval_s = startup_s, interval_s

    def at(self, t: float) -> int:
        return max(0, bisect.bisect_right(self.starts, t) - 1)

    def floor(self, now: float) -> tuple[int, int]:
        """The pools a fleet on this schedule holds at `now`: the most of each that any period needs
        from now until a worker added at the next decision would serve (that decision covers the rest)."""
        ready = now + self.startup_s + self.interval_s
        near = self.counts[self.at(now):max(1, bisect.bisect_left(self.starts, ready))]
        return max(c[0] for c in near), max(c[1] for c in near)

    def targets(self, now: float, arrived: int, waiting: tuple[int, int], load=None) -> tuple[int, int]:
        return self.floor(now)  # (what the gateway shows changes nothing)


def zone(name: str) -> tzinfo:
    """The IANA time zone `name` (ValueError: an unknown one)."""
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ValueError(f"--timezone: unknown time zone {name!r} (an IANA name: Europe/Berlin, UTC …)") from None


class Schedule:
    """A `pdserve plan --forecast --json` result's pools on the planner's clock, for the forecast
    policy's floor (`--schedule PLAN.json`): with clock times, by the time of day in the plan's
    zone (`--timezone`; without one, this machine's local time), day after day; with seconds, from
    when the planner started, the last period's pools after the horizon. `floor(now)` ignores `now`
    (a monotonic clock) and reads its own."""

    def __init__(self, plan: dict[str, Any], interval_s: float, wall=time.time, started: float | None = None):
        rows = plan.get("periods") if isinstance(plan, dict) else None
        if not rows or plan.get("recommended") is None:
            raise ValueError("the schedule holds no periods: give a `pdserve plan --forecast ... --json` result "
                             "that found a configuration")
        starts = [float(r["start_s"]) for r in rows]
        counts = [(int(r["prefill"]), int(r["decode"])) for r in rows]
        self.clock, self.first, self.wall = bool(plan.get("clock")), starts[0], wall
        self.tz = zone(plan["timezone"]) if plan.get("timezone") else None
        if self.clock:  # the next day's periods too: a decision before midnight looks past it
            starts, counts = starts + [t + DAY_S for t in starts], counts + counts
        self.started = wall() if started is None else started
        self.scaler = ScheduleScaler(starts, counts, float(plan.get("startup_s", 0.0)), interval_s)

    @classmethod
    def load(cls, path: str | Path, interval_s: float) -> Schedule:
        try:
            return cls(json.loads(Path(path).read_text()), interval_s)
        except (KeyError, TypeError, ValueError) as exc:  # (json.JSONDecodeError is a ValueError)
            raise ValueError(f"{path}: not a `pdserve plan --forecast` result ({exc})") from None

    def at(self) -> float:
        """Where in the schedule the planner's clock is now."""
        now = self.wall()
        if not self.clock:
            return self.first + now - self.started
        t = datetime.fromtimestamp(now, self.tz) if self.tz else datetime.fromtimestamp(now).astimezone()
        day_s = t.hour * 3600 + t.minute * 60 + t.second + now % 1
        return day_s if day_s >= self.first else day_s + DAY_S

    def floor(self, _now: float = 0.0) -> tuple[int, int]:
        return self.scaler.floor(self.at())


def _requests_at(args, rate: float, trace: list[SimRequest] | None) -> list[SimRequest]:
    """The search window's requests at `rate`: the bench workload at that Poisson rate, or the
    trace (cut to --duration) with its arrivals stretched to that mean rate."""
    if rate <= 0:
        return []
    if trace is None:
        return list(poisson_requests(args.workload, rate, args.seed, duration_s=args.duration,
                                     num_requests=args.num_requests, prompt_tokens=args.input_len,
                                     output_tokens=args.output_len))
    stretch = _trace_rate(trace) / rate
    reqs = [replace(r, arrival_s=r.arrival_s * stretch) for r in trace]
    return [r for r in reqs if args.duration is None or r.arrival_s < args.duration]


def _trace_rate(trace: list[SimRequest]) -> float:
    span = trace[-1].arrival_s - trace[0].arrival_s
    if span <= 0:
        raise ValueError("the trace's requests all arrive at once: it has no rate to stretch to the forecast's")
    return (len(trace) - 1) / span


def forecast_arrivals(args, warp: Warp, trace: list[SimRequest] | None) -> list[SimRequest]:
    """Arrivals over the whole forecast: unit-rate ones (the bench workload's Poisson process, or
    the trace in units of its own mean gap, repeated as often as needed) laid on the forecast."""
    if trace is None:
        unit = poisson_requests(args.workload, 1.0, args.seed + 1, duration_s=warp.total,
                                prompt_tokens=args.input_len, output_tokens=args.output_len)
        return [replace(r, arrival_s=warp.time_of(r.arrival_s)) for r in unit]
    rate, out, offset, repeat = _trace_rate(trace), [], 0.0, 0
    span_u = (trace[-1].arrival_s - trace[0].arrival_s) * rate + 1.0  # one more mean gap between repeats
    while offset < warp.total:
        for r in trace:
            u = offset + (r.arrival_s - trace[0].arrival_s) * rate
            if u >= warp.total:
                break
            # a repeat shares prefixes within itself, not with the trace before it (its prompts would
            # all be cached whole)
            keys = r.prefix_keys if not repeat else tuple((repeat, k) for k in r.prefix_keys)
            out.append(replace(r, arrival_s=warp.time_of(u), prefix_keys=keys))
        offset, repeat = offset + span_u, repeat + 1
    if repeat > 1:
        log.info("the trace's %d requests were laid on the forecast %d times (%d arrivals)", len(trace), repeat,
                 len(out))
    return out


def plan_forecast(args, profile: Profile, spec, prefill_profiles: dict[str, Profile],
                  decode_profiles: dict[str, Profile]) -> dict[str, Any]:
    from services.planner.plan import Planner, fork_map

    periods, is_clock = read_forecast(args.forecast)
    tz = getattr(args, "timezone", None)
    if tz is not None:
        if not is_clock:
            raise ValueError(f"--timezone: {args.forecast}'s times are seconds, not times of day")
        zone(tz)  # an unknown zone: an error now, not when the plan is read back
    trace = read_trace(args.trace, time_scale=args.time_scale) if args.trace else None
    if trace is None and args.duration is None and args.num_requests is None:
        raise ValueError("give --duration (or --num-requests): the window each rate is searched on")
    plans: dict[float, dict[str, Any] | None] = {}

    jobs = getattr(args, "jobs", 1)

    def plan_at(rate: float, shape: dict[str, Any] | None, searches_at_once: int = 1) -> dict[str, Any] | None:
        if rate not in plans:
            s, pre, dec, pairings = spec, prefill_profiles, decode_profiles, None
            if shape is not None:  # the busiest period's shape: only the pools' sizes are searched
                s = replace(spec, modes=(shape["mode"],), chunk_budgets=(shape["chunk_budget"],),
                            prefill_inflights=(shape["prefill_inflight"],))
                pairings = [(shape["prefill_profile"], shape["decode_profile"])]
            reqs = _requests_at(args, rate, trace)
            log.info("planning %.4g req/s (%d requests)", rate, len(reqs))
            plans[rate] = Planner(profile, s, lambda: [replace(r) for r in reqs], args.slo_tpot_ms, pre, dec,
                                  pairings=pairings).plan(searches_at_once)["recommended"]
        return plans[rate]

    peak_rate = max(p.rate for p in periods)
    peak = plan_at(peak_rate, None, jobs)  # its searches at once
    if peak is None:
        return {"forecast": args.forecast, "peak_rate": peak_rate, "recommended": None,
                "why": f"no configuration within the budget ({spec.budget} workers"
                       + (f", {spec.gpu_budget:g} GPUs" if spec.gpu_budget is not None else "")
                       + f") meets the SLOs at {peak_rate:g} req/s"}
    # every other rate, each a search of the peak's shape: the rates at once
    rates = sorted({p.rate for p in periods if p.rate > 0 and p.rate not in plans})
    plans.update(zip(rates, fork_map(lambda rate: plan_at(rate, peak), rates, jobs)))
    per_worker = _gpus_per_worker(peak, profile, prefill_profiles, decode_profiles)
    rows = []
    for p in periods:
        rec = plan_at(p.rate, peak) if p.rate > 0 else None
        if p.rate > 0 and rec is None:  # (the search is not monotone in the rate everywhere): the peak's
            log.warning("no plan of the peak's shape met the SLOs at %.4g req/s: its pools kept", p.rate)
            rec = peak
        pools = ((rec["prefill"], rec["decode"]) if rec is not None else
                 (0 if peak["mode"] == "colocated" else 1, 1))
        rows.append({"start_s": p.start_s, "end_s": p.end_s, "rate": p.rate, "prefill": pools[0],
                     "decode": pools[1], "gpus": pools[0] * per_worker[0] + pools[1] * per_worker[1],
                     "ttft_p90_ms": rec and rec["ttft_p90_ms"], "itl_p90_ms": rec and rec["itl_p90_ms"]})
    # a busier period never gets fewer workers in a pool than a quieter one (each rate's search is its own)
    for row in rows:
        for pool in ("prefill", "decode"):
            row[pool] = max(r[pool] for r in rows if r["rate"] <= row["rate"])
        row["gpus"] = row["prefill"] * per_worker[0] + row["decode"] * per_worker[1]
    horizon_s = periods[-1].end_s - periods[0].start_s
    result = {"forecast": args.forecast, "clock": is_clock, "timezone": tz, "recommended": peak,
              "slo": {"ttft_p90_ms": spec.slo_ttft_p90_ms, "itl_p90_ms": spec.slo_itl_p90_ms},
              "peak_rate": peak_rate, "startup_s": args.startup_s, "slo_tpot_ms": args.slo_tpot_ms, "periods": rows,
              "peak_held_gpu_hours": peak["gpus"] * horizon_s / 3600, "searched_rates": len(plans), "repairs": 0}
    for repair in range(args.repair + 1 if args.verify else 1):
        if repair and not _grow_where_missed(rows, result["verified"]["periods"], peak["mode"], per_worker,
                                             spec.budget, spec.gpu_budget):
            break
        result["repairs"] = repair
        result |= _schedule(rows, per_worker, args.startup_s, is_clock)
        if args.verify:
            result["verified"] = verify(args, profile, peak, periods, rows, trace, prefill_profiles,
                                        decode_profiles, spec)
            if result["verified"]["meets"]:
                break
    return result


def attained(ttft_pct: float, tpot_pct: float, both_pct: float, want: float) -> tuple[bool, bool]:
    """Whether a period's TTFT and TPOT count as met for `want`% of its requests. Where each is met but
    not both together, the one nearer its edge is the one missed (its pool is the one to grow)."""
    ttft_ok, tpot_ok = ttft_pct >= want, tpot_pct >= want
    if ttft_ok and tpot_ok and both_pct < want:
        return (False, True) if ttft_pct <= tpot_pct else (True, False)
    return ttft_ok, tpot_ok


def _schedule(rows: list[dict[str, Any]], per_worker: tuple[int, int], startup_s: float,
              is_clock: bool) -> dict[str, Any]:
    """The pools' changes between periods, and the GPU-hours of the whole: each period's GPUs over its
    length, and each added worker's loading before its period starts."""
    changes, gpu_s = [], sum(r["gpus"] * (r["end_s"] - r["start_s"]) for r in rows)
    following = rows[1:] + rows[:1] if is_clock else rows[1:]
    for before, after in zip(rows, following):
        start = after["start_s"] if after is not rows[0] else before["end_s"]
        for pool, gpus in zip(("prefill", "decode"), per_worker):
            a, b = before[pool], after[pool]
            if a != b:
                changes.append({"at_s": start - startup_s if b > a else start, "serving_from_s": start,
                                "pool": pool, "from": a, "to": b})
                gpu_s += max(0, b - a) * gpus * startup_s
    return {"changes": sorted(changes, key=lambda c: c["at_s"]), "gpu_hours": gpu_s / 3600}


def _grow_where_missed(rows: list[dict[str, Any]], got: list[dict[str, Any]], mode: str,
                       per_worker: tuple[int, int], budget: int, gpu_budget: float | None = None) -> bool:
    """Each period the verification found missing an SLO gets ~5% more workers in the pool that sets
    it (TTFT: prefill, or a colocated pool; TPOT: decode), within the budget (workers, and GPUs if
    given); whether any grew. (A period's misses may be its predecessor's backlog: the searches
    planned each rate from empty.)"""
    grew = False
    for row, g in zip(rows, got):
        if g["meets"]:
            continue
        pools = {"decode" if mode == "colocated" else "prefill"} if not g["ttft_ok"] else set()
        for pool in pools | ({"decode"} if not g["tpot_ok"] else set()):
            more = min(max(1, math.ceil(row[pool] * 0.05)), budget - row["prefill"] - row["decode"])
            if gpu_budget is not None:
                gpus = row["prefill"] * per_worker[0] + row["decode"] * per_worker[1]
                more = min(more, int((gpu_budget - gpus) // per_worker[1 if pool == "decode" else 0]))
            if more > 0:
                row[pool] += more
                row["repaired"] = row.get("repaired", 0) + 1
                grew = True
        row["gpus"] = row["prefill"] * per_worker[0] + row["decode"] * per_worker[1]
    return grew


def _gpus_per_worker(shape: dict[str, Any], profile: Profile, prefill_profiles, decode_profiles) -> tuple[int, int]:
    """GPUs a prefill and a decode worker of this shape occupy (its pools' profiles: the main one unless named)."""
    pre, dec = shape["prefill_profile"], shape["decode_profile"]
    return ((prefill_profiles[pre] if pre else profile).limits.gpus_per_worker,
            (decode_profiles[dec] if dec else profile).limits.gpus_per_worker)


def verify(args, profile: Profile, shape: dict[str, Any], periods: list[Period], rows: list[dict[str, Any]],
           trace: list[SimRequest] | None, prefill_profiles, decode_profiles, spec) -> dict[str, Any]:
    """One simulation of the whole forecast, resized by the schedule; what each period got."""
    from services.planner.plan import pool_profiles

    warp = Warp(periods)
    arrivals = forecast_arrivals(args, warp, trace)
    starts = [p.start_s - warp.t0 for p in periods]
    counts = [(r["prefill"], r["decode"]) for r in rows]
    interval_s = min(60.0, min(p.length_s for p in periods) / 2)
    main, prefill = pool_profiles(profile, prefill_profiles.get(shape["prefill_profile"]),
                                  decode_profiles.get(shape["decode_profile"]))
    scaler = ScheduleScaler(starts, counts, args.startup_s, interval_s)
    initial = scaler.floor(0.0)  # a fleet already on the schedule: ready for what comes next
    config = ClusterConfig(mode=shape["mode"], prefill=max(1, initial[0]), decode=initial[1], kv_path=spec.kv_path,
                           max_num_batched_tokens=shape["chunk_budget"], prefill_max_inflight=shape["prefill_inflight"])
    cluster = Cluster(main, config, scaler=scaler, prefill_profile=prefill)
    cluster.run(arrivals)
    cluster.check_invariants(final=True)
    summary = cluster.report(spec.slo_ttft_p90_ms, spec.slo_itl_p90_ms)
    rec, overhead = cluster.rec, main.request_overhead_s
    arrival, first, finish = (np.array(x) for x in (rec.arrival, rec.first_s, rec.finish_s))
    out = np.array(rec.output)
    which = np.searchsorted(np.array(starts), arrival, side="right") - 1
    ttft_ok = (first - arrival + overhead) * 1e3 <= spec.slo_ttft_p90_ms
    tpot_slo_ms = args.slo_tpot_ms or spec.slo_itl_p90_ms
    tpot_ok = (out <= 1) | ((finish - first) / np.maximum(out - 1, 1) * 1e3 <= tpot_slo_ms)
    per_period = []
    for i in range(len(periods)):
        mine = which == i
        done = mine & (finish >= 0)
        ttft = (first - arrival + overhead)[done] * 1e3
        multi = done & (out > 1)
        tpot = ((finish - first) / np.maximum(out - 1, 1))[multi] * 1e3
        got = {"requests": int(mine.sum()), "unfinished": int(mine.sum() - done.sum()),
               "ttft_p90_ms": float(np.percentile(ttft, 90)) if ttft.size else None,
               "tpot_p90_ms": float(np.percentile(tpot, 90)) if tpot.size else None}
        if spec.attainment_pct is None:  # the p90 form
            got["ttft_ok"] = not got["unfinished"] and (got["ttft_p90_ms"] or 0) <= spec.slo_ttft_p90_ms
            got["tpot_ok"] = not got["unfinished"] and (got["tpot_p90_ms"] or 0) <= spec.slo_itl_p90_ms
        else:  # the share of the period's requests within each SLO, and within both (unfinished: neither)
            n, a = max(1, got["requests"]), spec.attainment_pct
            within = (ttft_ok[mine & done].sum(), tpot_ok[mine & done].sum(), (ttft_ok & tpot_ok)[mine & done].sum())
            got["ttft_pct"], got["tpot_pct"], got["both_pct"] = (100.0 * float(x) / n for x in within)
            got["ttft_ok"], got["tpot_ok"] = attained(got["ttft_pct"], got["tpot_pct"], got["both_pct"], a)
        got["meets"] = got["ttft_ok"] and got["tpot_ok"]
        per_period.append(got)
    # the run ends with its last request; the schedule's workers after it (an idle evening) are paid for too
    end, horizon = max(rec.finish_s, default=0.0), warp.starts[-1] + periods[-1].length_s
    gpu_s = summary["per_gpu"]["gpus"] * end + max(0.0, horizon - end) * rows[scaler.at(end)]["gpus"]
    itl = summary["itl_ms"]["p90"] if summary["itl_ms"] else None
    return {"requests": len(arrivals), "ttft_p90_ms": summary["ttft_ms"]["p90"] if summary["ttft_ms"] else None,
            "itl_p90_ms": itl, "tpot_p90_ms": summary["tpot_ms"]["p90"] if summary.get("tpot_ms") else None,
            "meets": all(p["meets"] for p in per_period) and (spec.attainment_pct is not None or
                                                              (itl or 0) <= spec.slo_itl_p90_ms),
            "gpu_hours": gpu_s / 3600, "simulated_s": end, "changes": summary["scaling"]["changes"],
            "periods": per_period}


def _clock(s: float) -> str:
    s = s % DAY_S
    return f"{int(s // 3600):02d}:{int(s % 3600 // 60):02d}" + (f":{int(s % 60):02d}" if s % 60 else "")


def format_forecast(result: dict[str, Any], spec) -> list[str]:
    if result.get("recommended") is None:
        return [f"pdserve plan --forecast: {result['why']}"]
    from services.planner.plan import _describe, slo_text

    when = _clock if result["clock"] else (lambda s: f"{s:g} s")
    v = result.get("verified")
    zone_text = (f", times of day in {result['timezone']}" if result.get("timezone") else
                 ", times of day in the local time of whoever reads it back" if result["clock"] else "")
    lines = [f"pdserve plan --forecast {result['forecast']}: SLOs {slo_text(spec, result.get('slo_tpot_ms'))}; "
             f"{len(result['periods'])} periods{zone_text}, {result['searched_rates']} rates searched",
             f"the busiest period ({result['peak_rate']:g} req/s): {_describe(result['recommended'])}",
             "  from      req/s   prefill  decode   GPUs   planned TTFT/ITL p90" +
             ("   verified TTFT/TPOT p90" if v else "")]
    for i, r in enumerate(result["periods"]):
        planned = (f"{r['ttft_p90_ms']:7.0f} / {r['itl_p90_ms']:5.1f} ms" if r["ttft_p90_ms"] is not None
                   else "        idle      ")
        line = (f"  {when(r['start_s']):>8s} {r['rate']:7.3g} {r['prefill']:9d} {r['decode']:7d} {r['gpus']:6d}"
                f"   {planned}")
        if r.get("repaired"):
            line += "  grown"
        if v:
            got = v["periods"][i]
            line += (f"   {got['ttft_p90_ms']:7.0f} / {got['tpot_p90_ms'] or 0:5.1f} ms ({got['requests']} requests"
                     + (f", {got['both_pct']:.1f}% within both" if "both_pct" in got else "")
                     + (f", {got['unfinished']} unfinished" if got["unfinished"] else "") + ")"
                     + ("" if got["meets"] else "  MISSES THE SLOs")
                     if got["ttft_p90_ms"] is not None else "   no arrivals")
        lines.append(line)
    for c in result["changes"]:
        grow = c["to"] > c["from"]
        lines.append(f"  at {when(c['at_s'])}: {'add' if grow else 'drain'} {abs(c['to'] - c['from'])} {c['pool']} "
                     f"({c['from']} -> {c['to']})" + (f", serving from {when(c['serving_from_s'])}" if grow else ""))
    held = result["peak_held_gpu_hours"]
    lines.append(f"GPU-hours: {result['gpu_hours']:.4g} (workers loading {result['startup_s']:g} s included), against "
                 f"{held:.4g} for the busiest period's configuration held throughout "
                 f"({held / result['gpu_hours']:.2f}x)")
    if v:
        lines.append(f"verified: {v['requests']} requests over the forecast in one simulation, resized {v['changes']} "
                     f"times: TTFT p90 {v['ttft_p90_ms']:.0f} ms, ITL p90 {v['itl_p90_ms']:.1f} ms, "
                     f"{v['gpu_hours']:.4g} GPU-hours; " + ("every period meets the SLOs" if v["meets"] else
                                                            "NOT every period meets the SLOs")
                     + (f" (after {result['repairs']} rounds of growing the pools of the periods that missed: "
                        "`grown` above)" if result["repairs"] else ""))
    return lines


def cmd_plan_forecast(args, profile: Profile, spec, prefill_profiles, decode_profiles) -> int:
    from services.planner.plan import add_caveat, emit, up_command

    result = plan_forecast(args, profile, spec, prefill_profiles, decode_profiles)
    lines = format_forecast(result, spec)
    rec = result.get("recommended")
    slos = f" --slo-ttft-p90-ms {spec.slo_ttft_p90_ms:g} --slo-itl-p90-ms {spec.slo_itl_p90_ms:g}"
    add_caveat(result, lines, profile)
    if rec is not None and rec["mode"] == "colocated":  # one pool: the forecast policy (and its floor) sizes two
        lines.append("run it (the busiest period's size, the reactive policy resizing it): " +
                     up_command(rec, f" --autoscale{slos}"))
    elif rec is not None:
        saved = args.json if args.json and args.json != "-" else "PLAN.json"
        lines.append("run it (the busiest period's shape, each pool never below the schedule): " +
                     up_command(rec, f" --autoscale --policy forecast --schedule {saved}{slos}"))
    emit(result, lines, args.json)
    return 0 if result.get("recommended") is not None else 1

