"""How far can following the load take the planning study's goal? The planned split resized through
the hour (BENCHMARKS.md, the planning study) by a forecaster that knows the trace's true arrival
rate — the sine its arrivals were drawn from — a startup ahead, and shrinks at once (no hysteresis):
the best any forecast can do with the profile sizer. Each run against the study's static 1:1 row
(the same trace, seed and SLOs, from the results file).

    python benchmarks/oracle_follow.py benchmarks/results/planning-study-mooncake-bend.json \
        0.03:120 0,0.03:120 forecast:0.03:120 --out oracle.json     (≈ 3.5 min a run on one core)

HEADROOM, or PREFILL,DECODE headrooms (each pool's own), then the startup in seconds; `forecast:`
runs the study's own forecaster (services/planner/forecast.py) instead of the oracle. A study of
several days (`--days`): the runs too, measured on the last day.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))

from services.planner.forecast import ForecastScaler, ProfileSizer  # noqa: E402
from services.planner.plan import pool_profiles  # noqa: E402
from services.planner.study import config_of, trace  # noqa: E402
from shared.sim.cluster import simulate  # noqa: E402
from shared.sim.cost import load_profile  # noqa: E402

PROFILES = Path(__file__).parents[1] / "shared/sim/profiles"


class Oracle(ForecastScaler):
    """ForecastScaler whose forecast is the true rate: its highest from now to a startup and an
    interval ahead (what a worker removed now misses, and what one added now must meet)."""

    mean_rate: float = 0.0
    period_s: float = 3600.0

    def rate_at(self, t: float) -> float:
        return self.mean_rate * (1 + 0.5 * math.sin(2 * math.pi * t / self.period_s))

    def forecast(self) -> float:
        now = self._last[0] if self._last else 0.0
        ahead = self.startup_s + self.interval_s
        return max(self.rate_at(now + ahead * k / 20) for k in range(21))


class PoolHeadroom:
    """A sizer with each pool's own headroom over the forecast (the scaler's own set to 0)."""

    def __init__(self, sizer, headroom: tuple[float, float]):
        self.sizer, self.headroom = sizer, headroom

    def workers(self, pool, rate, mix):
        return self.sizer.workers(pool, rate * (1 + self.headroom[pool]), mix)

    def describe(self):
        return self.sizer.describe() | {"pool_headroom": list(self.headroom)}

    def __getattr__(self, name):  # step(), for the decode correction
        return getattr(self.sizer, name)


def run(study: dict, headroom: tuple[float, float], startup_s: float, oracle: bool = True,
        interval_s: float = 60.0) -> dict:
    main_profile = load_profile(study["profile"])
    planned = study["rows"]["planned"]
    pools = {name: load_profile(PROFILES / f"{name}.json") for name in study["prefill_profiles"]}
    main, prefill = pool_profiles(main_profile, pools.get(planned["prefill_profile"]),
                                  pools.get(planned["decode_profile"]))
    config = config_of("planned", planned)
    slo = study["slo"]
    sizer = ProfileSizer(main, slo["ttft_ms"] / 1e3, slo["tpot_ms"] / 1e3, slo["attainment_pct"] / 100,
                         kv_path="network")
    room = headroom  # (prefill, decode): the scaler's own per-pool headroom
    if oracle and headroom[0] != headroom[1]:  # as its recorded runs: each pool's headroom on its backlog too
        sizer, room = PoolHeadroom(sizer, headroom), 0.0
    common = dict(interval_s=interval_s, startup_s=startup_s, headroom=room, current=[config.prefill, config.decode],
                  max_workers=(400, 400), budget=400)
    if oracle:
        scaler = Oracle(sizer, down_after=1, down_after_falling=1, curvature=False, **common)
        scaler.mean_rate, scaler.period_s = study["rate"], study["duration_s"]
    else:  # the study's forecaster, as its resized rows run it
        scaler = ForecastScaler(sizer, **common)
    days = study.get("days", 1)  # a study of several days: its rows on the last one, the days before a warm-up
    full = trace(study["rate"], study["duration_s"], 0, days)
    t0 = time.perf_counter()
    s = simulate(main, config, full, slo_ttft_ms=slo["ttft_ms"], slo_tpot_ms=slo["tpot_ms"], scaler=scaler,
                 prefill_profile=prefill, measure_from_s=(days - 1) * study["duration_s"])
    gpus = s["per_gpu"]["gpus"]
    per_gpu = s["goodput"]["request_goodput"] / gpus
    static = study["rows"]["static 1:1"]
    return {"scaler": "oracle" if oracle else "forecast", "headroom": headroom, "startup_s": startup_s,
            "gpus": gpus, "attainment_pct": s["goodput"]["attainment_pct"],
            "slo_attainment": s["slo_attainment"], "goodput_per_gpu": per_gpu,
            "vs_static_1_1": per_gpu / static["goodput_per_gpu"], "changes": s["scaling"]["changes"],
            "wall_s": time.perf_counter() - t0, "log": s["scaling"]["log"],
            "slo_by_window": s["scaling"].get("slo_by_window")}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("study", help="a planning study's results (its planned and static 1:1 rows)")
    p.add_argument("runs", nargs="+", metavar="[forecast:]HEADROOM[,DECODE_HEADROOM]:STARTUP",
                   help="the oracle, or with 'forecast:' the study's forecaster; one headroom or one per pool")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    study = json.loads(Path(args.study).read_text())
    out = []
    for spec in args.runs:
        oracle = not spec.startswith("forecast:")
        room, startup = spec.removeprefix("forecast:").split(":")
        rooms = [float(x) for x in room.split(",")]
        out.append(run(study, (rooms[0], rooms[-1]), float(startup), oracle))
        print(json.dumps({k: v for k, v in out[-1].items() if k not in ("log", "slo_by_window")}), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
