"""The predictive fleet planner: forecast, hysteresis, bounds, and in the simulator a step in load."""

from __future__ import annotations

from dataclasses import replace

import pytest

from services.planner.forecast import Capacity, ForecastScaler
from shared.sim.cluster import ClusterConfig, simulate
from shared.sim.workload import poisson_requests
from tests.sim.test_simulator import PROFILE


def _feed(scaler, rates, start=0.0, arrived=0):
    """Drive `scaler` through intervals with these arrival rates; the decisions."""
    out, t = [], start
    scaler.targets(t, arrived)
    for r in rates:
        t += scaler.interval_s
        arrived += round(r * scaler.interval_s)
        out.append(scaler.targets(t, arrived))
    return out


def test_forecast_follows_the_trend_a_startup_ahead():
    s = ForecastScaler(Capacity(10.0, 20.0), interval_s=60, startup_s=120, headroom=0.0, history=5)
    _feed(s, [100, 110, 120, 130, 140])
    assert s.forecast() == pytest.approx(140 + 10 * 3)  # three intervals past the last one observed
    s = ForecastScaler(Capacity(10.0, 20.0), interval_s=60, startup_s=120, headroom=0.0, history=5)
    _feed(s, [140, 130, 120, 110, 100])
    # falling: a worker removed now is missing from the next interval on, so the next one's rate counts
    assert s.forecast() == pytest.approx(100 - 10)
    s = ForecastScaler(Capacity(10.0, 20.0), interval_s=60, startup_s=0, headroom=0.0)
    _feed(s, [100, 50, 0, 0, 0])
    assert s.forecast() == 0.0  # never below zero


def test_grows_at_once_shrinks_only_after_a_run_of_lower_wants():
    s = ForecastScaler(Capacity(10.0, 20.0), interval_s=10, startup_s=0, headroom=0.0, history=2, down_after=3,
                       current=[1, 1])
    ups = _feed(s, [100, 100, 100])
    assert ups[-1] == (10, 5)
    downs = _feed(s, [50, 50, 50, 50], start=30, arrived=3000)
    # the first interval at 50 still forecasts 0 by the trend (100 → 50 → 0): a dip is not acted on
    # until three intervals in a row want fewer, and then the most of them
    assert downs[:2] == [(10, 5), (10, 5)] and downs[2] == (5, 3)


def test_bounds_and_budget():
    s = ForecastScaler(Capacity(1.0, 1.0), interval_s=10, startup_s=0, headroom=0.0, min_workers=(2, 1),
                       max_workers=(50, 8), budget=40, current=[2, 1])
    (last,) = _feed(s, [100])[-1:]
    assert last[1] <= 8 and sum(last) <= 40 and last[0] >= 2
    (quiet,) = _feed(s, [0] * 12, start=10, arrived=1000)[-1:]
    assert quiet == (2, 1)
    with pytest.raises(ValueError):
        ForecastScaler(Capacity(1.0, 1.0), min_workers=(3, 3), budget=5)
    with pytest.raises(ValueError):
        Capacity.from_plan(0.0, 1, 1)


def test_step_in_load_in_the_simulator_up_steady_then_down_to_the_minimum():
    """Quiet (1 req/s), then a step to 6 req/s for two minutes, then nothing: the fleet grows within
    a few intervals of the step, holds still while the load is steady, drains to the minimum after."""
    quiet = list(poisson_requests("chat", 1.0, 1, duration_s=40.0))
    busy = [replace(r, arrival_s=40.0 + r.arrival_s) for r in poisson_requests("chat", 6.0, 2, duration_s=120.0)]
    busy.append(replace(quiet[0], arrival_s=300.0))  # one late request: the run goes on past the quiet
    cap = Capacity(1.5, 1.0)  # about what this profile's workers sustain on chat
    scaler = ForecastScaler(cap, interval_s=5.0, startup_s=5.0, headroom=0.1, history=4, down_after=3,
                            max_workers=(8, 10), budget=16, current=[1, 1])
    s = simulate(PROFILE, ClusterConfig(prefill=1, decode=1), quiet + busy, scaler=scaler, check=True)
    assert s["completed"] == s["sent"] == len(quiet) + len(busy)
    log = s["scaling"]["log"]  # (time, prefill, decode) after each change
    assert all(p + d <= 16 for _, p, d in log)
    grown = next(t for t, p, d in log if p >= 4)  # 6 req/s ÷ 1.5 per prefill worker
    assert 40.0 < grown <= 40.0 + 4 * 5.0
    steady = [(t, p, d) for t, p, d in log if 80.0 <= t <= 160.0]
    assert len(steady) <= 2, steady  # no flipping while the load holds
    assert log[-1][1:] == [1, 1] and log[-1][0] < 300.0
    assert s["cost"]["prefill"]["max_workers"] <= 8
    # and it paid for less than a fleet sized for the step all along
    fixed = simulate(PROFILE, ClusterConfig(prefill=max(p for _, p, _ in log), decode=max(d for *_, d in log)),
                     [replace(r) for r in quiet + busy])
    assert s["per_gpu"]["gpus"] < fixed["per_gpu"]["gpus"]
