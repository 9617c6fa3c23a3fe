"""The study's forecaster alone, fed the planning study's arrivals minute by minute, against the
oracle's want: how many workers it holds where one worker carries 1 req/s (no sizer, no headroom,
no simulation: what the forecast and the hysteresis do, in seconds instead of minutes).

    python benchmarks/forecast_replay.py            (the mean fleet, the oracle's, and the excess by 5 minutes)
    python benchmarks/forecast_replay.py --minutes  (and each minute's decision)
    python benchmarks/forecast_replay.py --days 2 [--season]   (the second of two days: the forecaster warm
                                                               [and told the period])

The oracle's want is the true rate's highest from now to a startup and an interval ahead (as in
oracle_follow.py). The fleet starts at the peak's size, as the study's resized rows do.
"""

from __future__ import annotations

import argparse
import bisect
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))

from services.planner.forecast import Capacity, ForecastScaler  # noqa: E402
from services.planner.study import trace  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rate", type=float, default=240.0, help="the trace's mean req/s (it swings ±50% over the hour)")
    p.add_argument("--duration", type=float, default=3600.0)
    p.add_argument("--startup", type=float, default=120.0)
    p.add_argument("--interval", type=float, default=60.0)
    p.add_argument("--days", type=int, default=1, help="periods of the swing replayed; the last one is measured")
    p.add_argument("--season", action="store_true", help="the forecaster knows the period (its `season_s`)")
    p.add_argument("--minutes", action="store_true", help="print each decision")
    args = p.parse_args()
    arrivals = sorted(r.arrival_s for r in trace(args.rate, args.duration, 0, days=args.days))

    def rate(t: float) -> float:
        return args.rate * (1 + 0.5 * math.sin(2 * math.pi * t / args.duration))

    def oracle(t: float) -> int:
        ahead = args.startup + args.interval
        return math.ceil(max(rate(t + ahead * k / 20) for k in range(21)))

    peak = math.ceil(1.5 * args.rate)
    s = ForecastScaler(Capacity(1.0, 1.0), interval_s=args.interval, startup_s=args.startup, headroom=0.0,
                       current=[peak, peak], max_workers=(10**6, 10**6), budget=10**7,
                       season_s=args.duration if args.season else None)
    steps = int(args.duration // args.interval)
    fleet, want = [], []
    for k in range(steps * args.days):
        t = args.interval * k
        wants = s.targets(t, bisect.bisect_right(arrivals, t))[0]
        if k < steps * (args.days - 1):
            continue
        fleet.append(wants)
        want.append(oracle(t))
        if args.minutes:
            print(f"{t:6.0f} s  fleet {fleet[-1]:4d}  oracle {want[-1]:4d}  {fleet[-1] - want[-1]:+d}")
    excess = [f - w for f, w in zip(fleet, want)]
    per = max(1, round(300 / args.interval))
    windows = [sum(excess[i:i + per]) / len(excess[i:i + per]) for i in range(0, steps, per)]
    short = sum(min(0, e) for e in excess) / steps
    print(f"mean fleet {sum(fleet) / steps:.1f}, oracle {sum(want) / steps:.1f}, excess {sum(excess) / steps:+.1f}; "
          f"short {short:.1f}; by 5 minutes: " + " ".join(f"{w:+.0f}" for w in windows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
