"""The planning study of BENCHMARKS.md: at 1,000-GPU scale, on a trace with the published shape of
Mooncake's, how many GPUs does each way of deploying need to meet the same SLOs, and so what is
each one's goodput per GPU?

    planned      `pdserve plan`'s search: prefill and decode pools sized apart, for the peak; with
                 `--prefill-profile` the prefill pool may also run on another tensor-parallel group
                 (the same model on TP4 instead of TP8), with `--decode-profile` the decode pool too,
                 and with `--prefill-inflights` on another number of jobs a prefill worker takes at
                 once: the fewest GPUs wins
    planned, scaled over the hour
                 the same split, resized every minute by the forecast planner (services/planner/
                 forecast.py): each pool's capacity per worker from the planned configuration at
                 the peak, the load forecast a startup ahead from the arrivals so far
    … sized from the profile
                 the same, but each pool sized by the profile sizer (forecast.ProfileSizer): from
                 the profile and the mix of the requests finished lately, nothing from the search
                 but the fleet it starts as
    static 1:1   disaggregated, as many prefill as decode workers (the smallest such pair that meets them),
                 on the main profile (TP8) with its jobs at once; and again with the planned split's
                 number of jobs at once, so that the split is not credited with a knob the baseline
                 could turn too
    colocated    every worker does both, chunked prefill (the smallest count that meets them)

Goodput per GPU divides the requests that met both SLOs per second by the GPUs held on average
over the run (a fixed fleet: its size; a scaled one: GPU time ÷ duration, a worker paid for from
the decision to add it, through its model loading, until it has drained).

SLOs: TTFT and TPOT, each met by at least `attainment`% of requests and both together by that many
too. The rate is chosen so the planned configuration lands near the GPU target. Searches run on the
trace's busiest `search_s` seconds (its rate swings ±50% over the hour: sized for the peak, as a
static deployment must be); each winner is then checked on the whole trace. Colocated tries the
chunk budgets `colocated_chunks` and keeps the cheapest.

Sizing alone is bounded: static needs k = max(P, D) of each, so a split sized for the same peak
saves at most 2·max(P, D) / (P + D) < 2× in GPUs. Following the load through the hour saves at
most the ratio of the peak's load to the mean (1.5 for this trace's ±50% swing), less the headroom
and the workers paid for while they load or drain. The rest of a planner's gain has to come from
choosing each pool's parallelism: on the roofline, with the all-reduces of tensor parallelism priced
(services/planner/roofline.py), a prefill token costs less GPU time on TP4 than on TP8, while decode
carries more per GPU on TP8 (the weights read once a step for more sequences).

    python -m services.planner.study --out study.json      (≈ 30 min: 21 of them the searches)
    python -m services.planner.study --prefill-profile shared/sim/profiles/roofline-llama3-70b-tp4-h100.json \
        --prefill-inflights 2,4,8 --max-workers 400 --out study.json
    python -m services.planner.study --configs-from study.json --out study2.json      (no searches: ≈ 10 min)
    python -m services.planner.study --configs-from study.json --days 3 --variant 0.02,0.08:120:profile:season \
        --out study3.json      (each row on the third of three days: the resized fleets warm, and a whole
                                day seen before each minute of it: on the second, a season's window
                                reaches back before the trace for its first minutes)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

from services.planner.forecast import Capacity, ForecastScaler, ProfileSizer, headroom_arg
from services.planner.plan import Planner, PlanSpec, fork_map, pool_profiles, positive_int
from services.planner.schedule import ScheduleScaler
from shared.sim.cluster import ClusterConfig, simulate
from shared.sim.cost import load_profile
from shared.sim.workload import _trace_row, mooncake_shaped_trace

log = logging.getLogger("pdserve.study")

SCHEDULED = "planned through a forecast of the hour (pdserve plan --forecast)"


def trace(rate: float, duration_s: float, seed: int, days: int = 1) -> list:
    """`days` periods of `duration_s` (the swing's period) in a row."""
    rows = mooncake_shaped_trace(days * duration_s, rate, seed, period_s=duration_s)
    return [_trace_row(row, 1.0) for row in rows]


def busiest(requests: list, window_s: float) -> list:
    """The `window_s` seconds of `requests` (sorted by arrival) with the most arrivals, shifted to start at 0."""
    best = (0, 0)
    j = 0
    for i, r in enumerate(requests):
        while requests[j].arrival_s < r.arrival_s - window_s:
            j += 1
        if i - j + 1 > best[1] - best[0]:
            best = (j, i + 1)
    start = requests[best[0]].arrival_s
    return [replace(r, arrival_s=r.arrival_s - start) for r in requests[best[0]:best[1]]]


Pools = tuple[str | None, str | None]  # the profiles (by name) a configuration's prefill and decode pools run on


def _search(planner: Planner, spec: PlanSpec, max_workers: int, colocated_chunks: tuple[int, ...],
            jobs: int = 1) -> tuple[dict[str, ClusterConfig | None], dict[str, Pools]]:
    """The configurations by name, and the profiles each one's pools run on (None: the main one).
    Each search is independent of the others of its round (the planned split's, then the baselines'):
    `jobs` of them run at once, and the answer is the one a single process gives."""
    found: dict[str, ClusterConfig | None] = {}
    on: dict[str, Pools] = {}
    tried = planner.at_once([partial(planner.plan_disaggregated, None, pp, inflight, dp)
                             for pp, dp in planner.pairings() for inflight in spec.prefill_inflights], jobs)
    planned = min((t for t in tried if t is not None), key=lambda t: t.gpus, default=None)
    found["planned"] = planned.config if planned else None
    on["planned"] = (planned.prefill_profile, planned.decode_profile) if planned else (None, None)
    # the baseline: equal pools on the main profile, each worker taking the profile's number of jobs at
    # once, and (where the planned split takes another) with the planned split's number too
    inflights = [None] + ([planned.config.prefill_max_inflight] if planned and
                          planned.config.prefill_max_inflight is not None else [])
    statics = [ClusterConfig(mode="disaggregated", kv_path="network", prefill_max_inflight=i) for i in inflights]
    colos = [ClusterConfig(mode="colocated", kv_path="network", max_num_batched_tokens=c) for c in colocated_chunks]

    def equal_pools(base: ClusterConfig) -> int | None:
        return planner.smallest(lambda k: replace(base, prefill=k, decode=k), lambda t: t.meets(spec), max_workers // 2)

    def one_pool(colo: ClusterConfig) -> int | None:
        return planner.smallest(lambda k: replace(colo, decode=k), lambda t: t.meets(spec), max_workers)

    counts = planner.at_once([partial(equal_pools, b) for b in statics] + [partial(one_pool, c) for c in colos],
                             jobs)
    for inflight, base, n in zip(inflights, statics, counts):
        name = "static 1:1" if inflight is None else f"static 1:1, {inflight} jobs a prefill worker"
        found[name] = replace(base, prefill=n, decode=n) if n else None
    found["colocated"] = None
    for colo, n in zip(colos, counts[len(statics):]):
        if n and (found["colocated"] is None or n < found["colocated"].decode):
            found["colocated"] = replace(colo, decode=n)
    return found, on


def config_of(name: str, row: dict[str, Any] | None) -> ClusterConfig | None:
    """A fixed configuration back from a row of an earlier result."""
    if row is None:
        return None
    mode = "colocated" if name == "colocated" else "disaggregated"
    return ClusterConfig(mode=mode, kv_path="network", prefill=max(1, round(row["prefill"])),
                         decode=round(row["decode"]), max_num_batched_tokens=row["chunk_budget"],
                         prefill_max_inflight=row.get("prefill_inflight"))


def run_study(profile_path: str, rate: float, duration_s: float, search_s: float, slo_ttft_ms: float,
              slo_tpot_ms: float, attainment: float, max_workers: int, seed: int = 0,
              colocated_chunks: tuple[int, ...] = (512, 1024, 2048), interval_s: float = 60.0,
              startup_s: float = 120.0, headroom: float | tuple[float, float] = 0.1,
              variants: tuple[tuple, ...] = (), configs_from: dict[str, Any] | None = None,
              prefill_profiles: tuple[str, ...] = (), prefill_inflights: tuple[int | None, ...] = (None,),
              decode_profiles: tuple[str, ...] = (), schedule: dict[str, Any] | None = None,
              jobs: int = 1, days: int = 1) -> dict[str, Any]:
    """`variants`: more (headroom, startup_s[, "capacity" | "profile"][, "line"][, "schedule"][, "season"]) for
    the scaled fleet, each a row of its own, sized by the planned split's capacity per worker (the default) or
    by the profile; "schedule": never below `schedule`'s pools (the forecast policy's floor); "season": the
    forecaster knows the swing's period (`duration_s`: ForecastScaler.season_s).
    `days`: the swing `days` times in a row, every row measured on the last one (the rows before it a
    warm-up: the resized fleets start as they would on a day that follows another, not as a deployment).
    `configs_from`: an earlier result of the study: its configurations are simulated again without
    the searches (for a change to the scaled fleet's policy, which the searches do not depend on).
    `prefill_profiles`, `decode_profiles`: files of the same model on other tensor-parallel groups,
    which the planned split's prefill (decode) pool may run on; `prefill_inflights`: the jobs a
    prefill worker takes at once that its search tries (None: the profile's).
    `schedule`: a `pdserve plan --forecast` result for this trace's load: a row of a fleet resized by
    its schedule (the load's shape known ahead, as a daily pattern is) instead of by the forecaster.
    `jobs`: searches (each round's) and rows run at once in forked processes; the answer is the same."""
    profile = load_profile(profile_path)
    prefill_pools = {Path(f).stem: load_profile(f) for f in prefill_profiles}
    decode_pools = {Path(f).stem: load_profile(f) for f in decode_profiles}
    pools = prefill_pools | decode_pools
    if days < 1 or (days > 1 and schedule is not None):
        raise ValueError("the study needs days >= 1, and one day for a schedule (its periods are the hour's)")
    full = trace(rate, duration_s, seed, days)
    search = busiest([r for r in full if r.arrival_s < duration_s], search_s)  # (the first day: as with days=1)
    spec = PlanSpec(slo_ttft_ms, slo_tpot_ms, max_workers, modes=("disaggregated",), kv_path="network",
                    attainment_pct=attainment, prefill_inflights=prefill_inflights)
    planner = Planner(profile, spec, lambda: [replace(r) for r in search], slo_tpot_ms, prefill_pools, decode_pools)
    t0 = time.perf_counter()
    if configs_from is not None:
        found = {name: config_of(name, row) for name, row in configs_from["rows"].items()
                 if not name.startswith("planned, scaled") and name != SCHEDULED}
        on = {name: (row.get("prefill_profile"), row.get("decode_profile"))
              for name, row in configs_from["rows"].items() if row}
        missing = {p for pair in on.values() for p in pair if p} - set(pools)
        if missing:
            raise ValueError(f"the earlier result's pools ran on {sorted(missing)}: give --prefill-profile / "
                             "--decode-profile for them")
    else:
        found, on = _search(planner, spec, max_workers, colocated_chunks, jobs)
    search_wall = time.perf_counter() - t0
    scalers: dict[str, ForecastScaler] = {}
    if found.get("planned") is not None:  # the planned split, resized through the hour
        p, (_, dp) = found["planned"], on["planned"]
        cap = Capacity.from_plan(len(search) / search_s, p.prefill, p.decode)
        # it starts as the planned fleet (sized for the peak) and follows the arrivals from there; the
        # profile sizer prices decode on the decode pool's profile (prefill: by the mix's measured seconds)
        sized = ProfileSizer(pools[dp] if dp else profile, slo_ttft_ms / 1e3, slo_tpot_ms / 1e3, attainment / 100,
                             kv_path="network")
        runs = [("planned, scaled over the hour", cap, headroom, startup_s, ()),
                ("planned, scaled over the hour, sized from the profile", sized, headroom, startup_s, ())]
        for room, startup, *how in variants:
            if "schedule" in how and schedule is None:
                raise ValueError("a variant with :schedule needs the plan's schedule (--schedule)")
            runs.append((f"planned, scaled over the hour{', sized from the profile' if 'profile' in how else ''} "
                         f"(headroom {_rooms(room)}, startup {startup:g} s"
                         f"{', a line forecast' if 'line' in how else ''}"
                         f"{', the forecast plan’s schedule as a floor' if 'schedule' in how else ''}"
                         f"{', the swing’s period known' if 'season' in how else ''})",
                         sized if "profile" in how else cap, room, startup, how))
        for name, sizer, room, startup, how in runs:
            # `line`: no bend, and hysteresis in a decline too (as the forecaster was until 2026-12-06's afternoon)
            old = {"curvature": False, "down_after_falling": ForecastScaler.down_after} if "line" in how else {}
            floor = _schedule_scaler(schedule, interval_s).floor if "schedule" in how else None
            scalers[name] = ForecastScaler(sizer, interval_s=interval_s, startup_s=startup, headroom=room,
                                           current=[p.prefill, p.decode], max_workers=(max_workers, max_workers),
                                           budget=max_workers, **old, floor=floor,
                                           season_s=duration_s if "season" in how else None)
            found[name] = p
            on[name] = on["planned"]
    if schedule is not None:
        name, shape = SCHEDULED, schedule["recommended"]
        scalers[name] = _schedule_scaler(schedule, interval_s)
        first = scalers[name].floor(0.0)
        found[name] = ClusterConfig(mode=shape["mode"], kv_path="network", prefill=max(1, first[0]), decode=first[1],
                                    max_num_batched_tokens=shape["chunk_budget"],
                                    prefill_max_inflight=shape["prefill_inflight"])
        on[name] = (shape["prefill_profile"], shape["decode_profile"])

    def row(name: str) -> dict[str, Any] | None:
        config = found[name]
        if config is None:
            return None
        scaler = scalers.get(name)
        pp, dp = on.get(name, (None, None))
        main, prefill = pool_profiles(profile, pools.get(pp), pools.get(dp))
        s = simulate(main, config, [replace(r) for r in full], slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms,
                     scaler=scaler, prefill_profile=prefill, measure_from_s=(days - 1) * duration_s)
        gpus = s["per_gpu"]["gpus"]  # a scaled fleet: the mean over the run
        cost = {k: v for k, v in s["cost"].items() if "workers" in v}
        gpw = {"prefill": (prefill or main).limits.gpus_per_worker}
        return {"prefill": round(cost.get("prefill", {}).get("workers", 0), 2),  # a scaled fleet: means
                "decode": round((cost.get("decode") or cost["colocated"])["workers"], 2),
                "prefill_profile": pp, "decode_profile": dp, "prefill_inflight": config.prefill_max_inflight,
                "max_gpus": sum(v["max_workers"] * gpw.get(k, main.limits.gpus_per_worker) for k, v in cost.items()),
                "scaling": _scaling(scaler, s, interval_s) if scaler else None,
                "chunk_budget": config.max_num_batched_tokens,
                "gpus": gpus, "requests": s["sent"], "request_goodput": s["goodput"]["request_goodput"],
                "goodput_per_gpu": s["goodput"]["request_goodput"] / gpus,
                "attainment_pct": s["goodput"]["attainment_pct"], "slo_attainment": s["slo_attainment"],
                "ttft_p90_ms": s["ttft_ms"]["p90"], "tpot_p90_ms": s["tpot_ms"]["p90"],
                "itl_p90_ms": s["itl_ms"]["p90"], "sim_wall_s": s["sim"]["wall_s"],
                "sim_requests_per_wall_s": s["sim"]["requests_per_wall_s"],
                "utilization": {k: v["utilization"] for k, v in s["cost"].items() if "utilization" in v}}

    # each row a whole run of the trace, `jobs` of them at once (their wall times then share the cores)
    rows = dict(zip(found, fork_map(row, list(found), jobs)))
    for name, r in rows.items():
        log.info("%s: %s", name, r)
    ratios = {}
    for mine in ("planned", "planned, scaled over the hour", "planned, scaled over the hour, sized from the profile",
                 SCHEDULED):
        for other in [name for name in rows if name.startswith("static 1:1")] + ["colocated"]:
            if rows.get(mine) and rows.get(other):
                ratios[f"{mine}_vs_{other}"] = rows[mine]["goodput_per_gpu"] / rows[other]["goodput_per_gpu"]
    return {"profile": profile_path, "profile_meta": profile.meta,
            "prefill_profiles": {name: pool.meta for name, pool in pools.items()}, "rate": rate,
            "duration_s": duration_s, "days": days,
            "search_s": search_s, "slo": {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms, "attainment_pct": attainment},
            "rows": rows, "goodput_per_gpu_ratios": ratios, "simulations": len(planner.trials) + len(found),
            "search_wall_s": search_wall if configs_from is None else configs_from.get("search_wall_s"),
            "searched": configs_from is None}


def _schedule_scaler(schedule: dict[str, Any], interval_s: float) -> ScheduleScaler:
    """A `pdserve plan --forecast` result's schedule, its first period at the trace's start."""
    periods = schedule["periods"]
    t0 = periods[0]["start_s"]
    return ScheduleScaler([p["start_s"] - t0 for p in periods], [(p["prefill"], p["decode"]) for p in periods],
                          schedule["startup_s"], interval_s)


def _scaling(scaler: ForecastScaler | ScheduleScaler, s: dict[str, Any], interval_s: float) -> dict[str, Any]:
    """How a resized fleet was resized: its policy's settings, its changes, the SLOs met per window."""
    out: dict[str, Any] = {"interval_s": interval_s, "startup_s": scaler.startup_s}
    if isinstance(scaler, ForecastScaler):
        out |= {"headroom": scaler.headroom, "curvature": scaler.curvature, "season_s": scaler.season_s,
                "down_after": [scaler.down_after, scaler.down_after_falling], **scaler.sizer.describe()}
    else:
        out["schedule"] = [list(x) for x in zip(scaler.starts, scaler.counts)]
    return out | {"changes": s["scaling"]["changes"], "log": s["scaling"]["log"],
                  "slo_by_window": s["scaling"].get("slo_by_window")}


def _rooms(room: float | tuple[float, float]) -> str:
    return f"{room:g}" if isinstance(room, (int, float)) else ",".join(f"{h:g}" for h in room)


FLAGS = ("line", "schedule", "season")  # a variant's, in this order after its sizer


def _variant(text: str) -> tuple:
    """HEADROOM:STARTUP[:capacity|:profile][:line][:schedule][:season] as (headroom, startup_s, *those flags);
    HEADROOM one for both pools, or PREFILL,DECODE."""
    try:
        room, startup, *how = text.split(":")
        sizer = [h for h in how[:1] if h in ("capacity", "profile")]
        flags = how[len(sizer):]
        if not all(f in FLAGS for f in flags) or flags != sorted(set(flags), key=FLAGS.index):
            raise ValueError
        return (headroom_arg(room), float(startup), *how)
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(f"{text!r}: want HEADROOM:STARTUP (HEADROOM: H or PREFILL,DECODE), then "
                                         ":capacity or :profile, then :line, :schedule, :season") from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.planner.study")
    p.add_argument("--profile", default=str(Path(__file__).parents[2] / "shared/sim/profiles/"
                                            "roofline-llama3-70b-tp8-h100.json"))
    p.add_argument("--rate", type=float, default=240.0, help="mean req/s of the trace")
    p.add_argument("--duration", type=float, default=3600.0)
    p.add_argument("--search", type=float, default=240.0, help="seconds of the trace the searches use")
    p.add_argument("--slo-ttft-ms", type=float, default=4000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=40.0)
    p.add_argument("--attainment", type=float, default=95.0)
    p.add_argument("--max-workers", type=int, default=250)
    p.add_argument("--interval", type=float, default=60.0, help="seconds between the scaled fleet's decisions")
    p.add_argument("--startup", type=float, default=120.0, help="seconds from adding a worker until it serves")
    p.add_argument("--headroom", type=headroom_arg, default=0.1, metavar="H | PREFILL,DECODE",
                   help="capacity above the forecast, for both pools or each its own")
    p.add_argument("--variant", action="append", default=[], type=_variant,
                   metavar="HEADROOM:STARTUP[:profile][:line][:schedule][:season]",
                   help="another scaled fleet with this headroom (H or PREFILL,DECODE) and startup, sized by the "
                        "planned capacity per worker or (':profile') from the profile; ':line': its forecast a line, "
                        "with no bend, and hysteresis in a decline too; ':schedule': never below --schedule's pools; "
                        "':season': the forecaster knows the swing's period (--duration) (repeatable)")
    p.add_argument("--prefill-profile", action="append", default=[], metavar="FILE",
                   help="the same model on another tensor-parallel group: the planned prefill pool may run on it "
                        "(repeatable)")
    p.add_argument("--decode-profile", action="append", default=[], metavar="FILE",
                   help="likewise for the planned split's decode pool (repeatable)")
    p.add_argument("--prefill-inflights", default="",
                   help="comma list of jobs a prefill worker takes at once, for the planned split's search "
                        "(default: the profile's)")
    p.add_argument("--configs-from", default=None, metavar="RESULTS.json",
                   help="simulate an earlier result's configurations again instead of searching")
    p.add_argument("--schedule", default=None, metavar="PLAN.json",
                   help="a `pdserve plan --forecast ... --json` result for this trace's load: one more row, the fleet "
                        "resized by its schedule")
    p.add_argument("--jobs", type=positive_int, default=len(os.sched_getaffinity(0)),
                   help="searches and rows run at once, each in a process of its own (default: the cores "
                        "this process may use)")
    p.add_argument("--days", type=positive_int, default=1,
                   help="the swing this many times in a row, the rows measured on the last (those before: a warm-up)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.days > 1 and args.schedule:
        p.error("--schedule plans one day: give --days 1")
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    result = run_study(args.profile, args.rate, args.duration, args.search, args.slo_ttft_ms, args.slo_tpot_ms,
                       args.attainment, args.max_workers, interval_s=args.interval, startup_s=args.startup,
                       headroom=args.headroom,
                       variants=tuple(args.variant),
                       configs_from=json.loads(Path(args.configs_from).read_text()) if args.configs_from else None,
                       prefill_profiles=tuple(args.prefill_profile), decode_profiles=tuple(args.decode_profile),
                       prefill_inflights=tuple(int(x) for x in args.prefill_inflights.split(",") if x.strip())
                       or (None,), schedule=json.loads(Path(args.schedule).read_text()) if args.schedule else None,
                       jobs=args.jobs, days=args.days)
    print(json.dumps(result["rows"], indent=1))
    print(json.dumps(result["goodput_per_gpu_ratios"]))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
