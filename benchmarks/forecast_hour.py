"""The inputs of BENCHMARKS.md's plan through a forecast of the planning study's hour: the study's
load (240 req/s swinging ±50% over the hour, services/planner/study.py) as two forecasts of
5-minute periods — each period's mean rate, and its most — and the request mix, a steady 600 s of
the same Mooncake-shaped trace (`pdserve plan --forecast --trace` stretches it to each rate).

    python benchmarks/forecast_hour.py --out /tmp/forecast      (hour-mean.csv, hour-max.csv, mix.jsonl: 40 MB)
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from shared.sim.workload import mooncake_shaped_trace

RATE, HOUR, PERIOD = 240.0, 3600.0, 300.0


def rate_at(t: float) -> float:
    return RATE * (1 + 0.5 * math.sin(2 * math.pi * t / HOUR))  # as mooncake_shaped_trace(period_s=HOUR)


def mean_rate(a: float, b: float) -> float:
    return RATE + RATE / 2 * (math.cos(2 * math.pi * a / HOUR) - math.cos(2 * math.pi * b / HOUR)) * HOUR / (
        2 * math.pi * (b - a))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    starts = [k * PERIOD for k in range(int(HOUR / PERIOD))]
    for name, rate in (("mean", lambda a: mean_rate(a, a + PERIOD)),
                       ("max", lambda a: max(rate_at(a + PERIOD * i / 300) for i in range(301)))):
        rows = [f"time,rate  # the planning study's hour: {RATE:g} req/s ±50%, the {name} of each 5 minutes"]
        rows += [f"{a:g},{rate(a):.1f}" for a in starts]
        (out / f"hour-{name}.csv").write_text("\n".join(rows) + "\n")
    with open(out / "mix.jsonl", "w") as f:
        for row in mooncake_shaped_trace(600.0, RATE, seed=0):
            f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
