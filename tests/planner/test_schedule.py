"""`pdserve plan --forecast`: a load forecast read, planned period by period with the busiest
period's shape, scheduled (pools grow a startup ahead, drain after) and verified in one simulation."""

from __future__ import annotations

import argparse
import json
import math
import shlex
import time
import subprocess
import sys

import pytest

from services.planner.plan import add_plan_args
from services.planner.schedule import (Period, ScheduleScaler, Warp, forecast_arrivals, plan_forecast,
                                       read_forecast)
from services.planner.plan import PlanSpec
from tests.planner.test_plan import PROFILE


def _write(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_forecast_is_read_with_clock_times_or_seconds_and_a_bad_row_is_named(tmp_path):
    periods, clock = read_forecast(_write(tmp_path, "day.csv", "time,rate\n06:00, 1.5\n09:30,3  # the morning\n"
                                                                 "\n18:00,0\n"))
    assert clock
    assert periods == [Period(6 * 3600, 9.5 * 3600, 1.5), Period(9.5 * 3600, 18 * 3600, 3.0),
                       Period(18 * 3600, 30 * 3600, 0.0)]  # the last one runs to 06:00 the next day
    periods, clock = read_forecast(_write(tmp_path, "s.csv", "0,2\n600,6\n900,1\n"))
    assert not clock and periods[-1] == Period(900, 1200, 1.0)  # as long as the one before it
    for text, what in (("0,2\n600,6\n300,1\n", "times must increase"), ("0,2\n60,x\n", "s.csv:2"),
                       ("0,2\n60,-1\n", "not negative"), ("0,2\n01:00,1\n", "mixes"), ("0,2\n", "at least two"),
                       ("0,0\n60,0\n", "every rate is 0"), ("0,2\n60,1,3\n", "s.csv:2"),
                       ("0,2\n25:00,1\n", "s.csv:2")):
        with pytest.raises(ValueError, match=what):
            read_forecast(_write(tmp_path, "s.csv", text))


def test_arrivals_follow_the_forecast_and_none_come_in_an_idle_period():
    periods = [Period(0, 600, 2.0), Period(600, 900, 8.0), Period(900, 1500, 0.0), Period(1500, 1800, 4.0)]
    warp = Warp(periods)
    assert warp.total == pytest.approx(2 * 600 + 8 * 300 + 4 * 300)
    args = argparse.Namespace(workload="chat", seed=3, input_len=None, output_len=None)
    arrivals = forecast_arrivals(args, warp, None)
    times = [r.arrival_s for r in arrivals]
    assert times == sorted(times)
    for p in periods:
        n = sum(p.start_s <= t < p.end_s for t in times)
        want = p.rate * p.length_s
        assert abs(n - want) <= 4 * math.sqrt(max(want, 1)), (p, n)  # Poisson: within 4 standard deviations
    assert not any(900 <= t < 1500 for t in times)


def test_a_trace_laid_on_a_longer_forecast_repeats_without_sharing_its_prefixes_with_itself():
    from shared.sim.workload import _trace_row, mooncake_shaped_trace

    trace = [_trace_row(row, 1.0) for row in mooncake_shaped_trace(30.0, 10.0, seed=1)]
    trace.sort(key=lambda r: r.arrival_s)
    warp = Warp([Period(0, 300, 4.0)])  # 1,200 arrivals from a trace of ~300
    out = forecast_arrivals(argparse.Namespace(), warp, trace)
    assert abs(len(out) - 1200) <= len(trace)
    first, second = out[:len(trace)], out[len(trace):2 * len(trace)]
    assert [r.prompt_tokens for r in first] == [r.prompt_tokens for r in second]  # the same requests again
    keys = lambda reqs: {k for r in reqs for k in r.prefix_keys}  # noqa: E731
    assert keys(first) and not keys(first) & keys(second)  # but no prompt of the repeat is cached by the first
    # within a repeat, requests still share prefixes as the trace's do
    assert sum(len(r.prefix_keys) for r in second) > len(keys(second))


def test_the_schedule_grows_a_pool_in_time_for_its_period_and_shrinks_it_after():
    scaler = ScheduleScaler([0.0, 600.0, 1200.0], [(2, 2), (5, 3), (1, 1)], startup_s=120.0, interval_s=60.0)
    # a decision reaches as far as a worker added at the next one would serve from
    assert scaler.targets(360.0, 0, (0, 0)) == (2, 2)
    assert scaler.targets(420.0, 0, (0, 0)) == (2, 2)  # the next decision (480 s) is still in time
    assert scaler.targets(480.0, 0, (0, 0)) == (5, 3)  # serving from 600 s: just in time
    assert scaler.targets(1140.0, 0, (0, 0)) == (5, 3)  # still in the busy period
    assert scaler.targets(1200.0, 0, (0, 0)) == (1, 1)  # drained at the quiet one's start
    assert scaler.targets(5000.0, 0, (0, 0)) == (1, 1)


def _args(tmp_path, *extra: str) -> argparse.Namespace:
    profile = _write(tmp_path, "profile.json", json.dumps(PROFILE.to_json()))
    p = argparse.ArgumentParser()
    add_plan_args(p)
    return p.parse_args(["--profile", str(profile), "--slo-ttft-p90-ms", "1500", "--slo-itl-p90-ms", "40",
                         "--budget", "24", "--modes", "disaggregated", "--workload", "long-doc",
                         "--output-len", "16-48", "--duration", "60", *extra])


def test_a_plan_through_a_forecast_sizes_each_period_with_the_peaks_shape_and_verifies_it(tmp_path):
    forecast = _write(tmp_path, "f.csv", "0,1\n300,4\n600,0\n800,2.5\n")
    args = _args(tmp_path, "--forecast", str(forecast), "--startup-s", "60")
    spec = PlanSpec(1500, 40, 24, ("disaggregated",))
    result = plan_forecast(args, PROFILE, spec, {}, {})
    peak, rows = result["recommended"], result["periods"]
    assert peak is not None and result["peak_rate"] == 4.0
    assert [r["rate"] for r in rows] == [1.0, 4.0, 0.0, 2.5]
    busy = [r for r in rows if r["rate"] > 0]
    assert max(busy, key=lambda r: r["gpus"]) is rows[1]  # the busiest period has the most
    assert rows[0]["gpus"] < rows[1]["gpus"] and rows[3]["gpus"] < rows[1]["gpus"]
    assert (rows[2]["prefill"], rows[2]["decode"]) == (1, 1)  # idle: the pools' minimum
    assert all(r["prefill"] + r["decode"] <= 24 for r in rows)
    # a pool that grows is added a startup before its period; one that shrinks drains at its start
    for c in result["changes"]:
        assert c["at_s"] == (c["serving_from_s"] - 60 if c["to"] > c["from"] else c["serving_from_s"])
    assert result["gpu_hours"] < result["peak_held_gpu_hours"]
    v = result["verified"]
    assert v["meets"], v["periods"]
    for p, got in zip(rows, v["periods"]):
        want = p["rate"] * (p["end_s"] - p["start_s"])
        assert abs(got["requests"] - want) <= 4 * math.sqrt(max(want, 1))
        if p["rate"]:
            assert got["ttft_p90_ms"] <= 1500 and got["tpot_p90_ms"] <= 40 and not got["unfinished"]
    # the one simulation pays for what the schedule says, loading included (it decides once a minute,
    # so it may add a worker up to a minute early)
    assert v["gpu_hours"] == pytest.approx(result["gpu_hours"], rel=0.15)


def test_a_period_that_misses_in_the_verification_is_grown_and_verified_again(tmp_path):
    """Each rate is searched from an empty system on its own stretch of the trace; the verification
    runs the forecast through: here the 70B roofline on a Mooncake-shaped trace, whose third period
    starts cold after an idle one and misses the TTFT SLO with the pools its rate was planned with.
    The periods that miss are grown, and the schedule verified again."""
    from shared.sim.cost import load_profile
    from shared.sim.workload import mooncake_shaped_trace
    from tests.planner.test_study import ROOFLINE

    rows = mooncake_shaped_trace(40.0, 20.0, seed=7)
    trace = _write(tmp_path, "t.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    forecast = _write(tmp_path, "f.csv", "0,20\n200,0\n300,15\n")
    p = argparse.ArgumentParser()
    add_plan_args(p)
    args = p.parse_args(["--trace", str(trace), "--forecast", str(forecast), "--slo-ttft-p90-ms", "3000",
                         "--slo-itl-p90-ms", "40", "--budget", "120", "--modes", "disaggregated", "--kv-path",
                         "network", "--startup-s", "60", "--repair", "0"])
    spec, profile = PlanSpec(3000, 40, 120, ("disaggregated",), kv_path="network"), load_profile(ROOFLINE)
    first = plan_forecast(args, profile, spec, {}, {})
    assert not first["verified"]["meets"] and first["repairs"] == 0
    missed = [i for i, g in enumerate(first["verified"]["periods"]) if not g["meets"]]
    args.repair = 3
    fixed = plan_forecast(args, profile, spec, {}, {})
    assert fixed["verified"]["meets"] and 1 <= fixed["repairs"] <= 3
    for i, (a, b) in enumerate(zip(first["periods"], fixed["periods"])):
        assert (b["gpus"] > a["gpus"]) == (i in missed) == bool(b.get("repaired"))
    assert fixed["gpu_hours"] > first["gpu_hours"]


def test_what_is_grown_is_the_pool_that_sets_the_missed_slo_within_the_budget():
    from services.planner.schedule import _grow_where_missed

    def rows():
        return [{"prefill": 20, "decode": 4, "gpus": 0} for _ in range(4)]

    got = [{"meets": True, "ttft_ok": True, "tpot_ok": True},
           {"meets": False, "ttft_ok": False, "tpot_ok": True},
           {"meets": False, "ttft_ok": True, "tpot_ok": False},
           {"meets": False, "ttft_ok": False, "tpot_ok": False}]
    r = rows()
    assert _grow_where_missed(r, got, "disaggregated", (4, 8), budget=100)
    assert [(x["prefill"], x["decode"]) for x in r] == [(20, 4), (21, 4), (20, 5), (21, 5)]
    assert [x["gpus"] for x in r[1:]] == [21 * 4 + 32, 20 * 4 + 40, 21 * 4 + 40]
    # a period's shares of requests within TTFT, TPOT and both, against 95%: where each is met but not
    # both, the pool nearer its edge is the one grown (at a sustained peak, decode's TPOT)
    from services.planner.schedule import attained

    assert attained(98.2, 95.1, 93.5, 95.0) == (True, False)
    assert attained(95.5, 98.0, 94.0, 95.0) == (False, True)
    assert attained(94.0, 99.0, 94.0, 95.0) == (False, True) and attained(99.0, 99.0, 98.5, 95.0) == (True, True)
    r = rows()  # colocated: one pool sets both
    _grow_where_missed(r, got, "colocated", (0, 8), budget=100)
    assert [(x["prefill"], x["decode"]) for x in r][1:] == [(20, 5), (20, 5), (20, 5)]
    r = rows()  # nothing beyond the budget
    assert not _grow_where_missed(r, got, "disaggregated", (4, 8), budget=24)
    assert all((x["prefill"], x["decode"]) == (20, 4) for x in r)
    r = rows()  # nor beyond the GPU budget: 112 GPUs, 4 free: one more prefill worker fits, no decode one
    assert _grow_where_missed(r, got, "disaggregated", (4, 8), budget=100, gpu_budget=116)
    assert [(x["prefill"], x["decode"]) for x in r] == [(20, 4), (21, 4), (20, 4), (21, 4)]
    assert max(x["gpus"] for x in r) <= 116


def test_plan_forecast_cli(tmp_path):
    forecast = _write(tmp_path, "day.csv", "time,rate\n00:00,0.2\n08:00,0.6\n20:00,0\n")
    out = tmp_path / "plan.json"
    proc = subprocess.run([sys.executable, "-m", "services.cli", "plan", "--forecast", str(forecast),
                           "--workload", "chat", "--duration", "60", "--slo-ttft-p90-ms", "5000",
                           "--slo-itl-p90-ms", "1000", "--budget", "4", "--modes", "disaggregated", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert data["clock"] and len(data["periods"]) == 3 and data["verified"]["requests"] > 0
    assert "08:00" in proc.stdout and "GPU-hours" in proc.stdout and "verified:" in proc.stdout
    # how to run it: the printed command line is one `pdserve up` takes (the schedule as its floor)
    [run] = [line for line in proc.stdout.splitlines() if line.startswith("run it")]
    command = shlex.split(run.split("): ", 1)[1])
    assert command[:2] == ["pdserve", "up"] and "--autoscale" in command
    assert ("--schedule" in command) == (data["recommended"]["mode"] != "colocated")
    if "--schedule" in command:
        assert command[command.index("--schedule") + 1] == str(out)
    dry = subprocess.run([sys.executable, "-m", "services.cli", *command[1:], "--dry-run"], capture_output=True,
                         text=True, timeout=120)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert f"--decode                       {data['recommended']['decode']} " in dry.stdout
    assert "SLOs: TTFT p90 5000 ms, ITL p90 1000 ms" in dry.stdout  # the autoscaler keeps the plan's SLOs
    # the zone of the forecast's times of day is recorded for whoever reads the plan back; a bad one is named
    zoned = subprocess.run([sys.executable, "-m", "services.cli", "plan", "--forecast", str(forecast), "--workload",
                            "chat", "--duration", "60", "--slo-ttft-p90-ms", "5000", "--slo-itl-p90-ms", "1000",
                            "--budget", "4", "--no-verify", "--timezone", "Europe/Berlin", "--json", "-"],
                           capture_output=True, text=True, timeout=300)
    assert zoned.returncode == 0 and json.loads(zoned.stdout)["timezone"] == "Europe/Berlin", zoned.stderr
    assert "times of day in Europe/Berlin" in zoned.stderr
    assert data["timezone"] is None and "local time of whoever reads it back" in proc.stdout
    seconds = _write(tmp_path, "secs.csv", "0,1\n60,2\n")
    for csv, tz, error in ((forecast, "Nowhere/Town", "unknown time zone 'Nowhere/Town'"),
                           (seconds, "UTC", "times are seconds, not times of day")):
        proc = subprocess.run([sys.executable, "-m", "services.cli", "plan", "--forecast", str(csv), "--workload",
                               "chat", "--duration", "60", "--slo-ttft-p90-ms", "5000", "--slo-itl-p90-ms", "1000",
                               "--budget", "4", "--timezone", tz], capture_output=True, text=True, timeout=120)
        assert proc.returncode != 0 and error in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    bad = _write(tmp_path, "bad.csv", "0,1\n60,oops\n")
    proc = subprocess.run([sys.executable, "-m", "services.cli", "plan", "--forecast", str(bad), "--workload", "chat",
                           "--duration", "60", "--slo-ttft-p90-ms", "5000", "--slo-itl-p90-ms", "1000",
                           "--budget", "4"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "bad.csv:2" in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_forecast_policy_holds_the_schedule_as_a_floor_and_follows_the_load_above_it():
    from services.planner.forecast import Capacity, ForecastScaler

    sched = ScheduleScaler([0.0, 100.0, 200.0], [(2, 1), (6, 3), (1, 1)], startup_s=20.0, interval_s=10.0)
    scaler = ForecastScaler(Capacity(2.0, 5.0), interval_s=10.0, startup_s=20.0, headroom=0.0, history=2,
                            down_after=3, floor=sched.floor)
    assert scaler.targets(0.0, 0) == (2, 1)  # nothing seen yet: the schedule's pools
    arrived, got = 0, {}
    for t in range(10, 300, 10):
        arrived += 20 if 130 <= t < 160 else 0  # a burst of 2 req/s the plan did not foresee: 1 prefill
        arrived += 200 if 240 <= t < 270 else 0  # and one of 20 req/s after it: 10 prefill, 4 decode
        got[t] = scaler.targets(float(t), arrived)
    assert got[50] == (2, 1)  # quiet: held at the floor, not the minimum
    assert got[70] == (2, 1) and got[80] == (6, 3)  # grown a startup and an interval before the period
    assert got[150] == (6, 3)  # the burst is within the floor
    # the floor drops at 200 s; the pools follow after three intervals wanting fewer (the hysteresis)
    assert got[200] == got[210] == (6, 3) and got[220] == (1, 1)
    assert got[260][0] >= 10 and got[260][1] >= 4  # the load above the floor is followed


def test_a_live_schedule_reads_the_time_of_day_or_the_time_since_it_started(tmp_path):
    from services.planner.schedule import Schedule

    plan = {"recommended": {"mode": "disaggregated"}, "clock": True, "startup_s": 120.0,
            "periods": [{"start_s": 6 * 3600.0, "prefill": 2, "decode": 1},
                        {"start_s": 9 * 3600.0, "prefill": 8, "decode": 3},
                        {"start_s": 18 * 3600.0, "prefill": 1, "decode": 1}]}
    today = time.localtime()

    def at(h, m):  # this machine's local time today
        return time.mktime((today.tm_year, today.tm_mon, today.tm_mday, h, m, 0, 0, 0, -1))

    now = [at(8, 50)]
    s = Schedule(plan, interval_s=60.0, wall=lambda: now[0])
    assert s.floor() == (2, 1)
    now[0] = at(8, 57)  # 3 minutes ahead: the next decision, a minute on, is still in time
    assert s.floor() == (2, 1)
    now[0] = at(8, 58)  # one added at the next decision would serve late: now
    assert s.floor() == (8, 3)
    now[0] = at(23, 0)
    assert s.floor() == (1, 1)
    now[0] = at(5, 58)  # before the first period: yesterday's last one, and 06:00 ahead
    assert s.floor() == (2, 1)
    now[0] = at(3, 0)
    assert s.floor() == (1, 1)
    secs = dict(plan, clock=False, periods=[{"start_s": 0.0, "prefill": 3, "decode": 2},
                                             {"start_s": 600.0, "prefill": 5, "decode": 2}])
    s = Schedule(secs, interval_s=60.0, wall=lambda: now[0], started=now[0])
    assert s.floor() == (3, 2)
    now[0] += 430  # past 600 - 120 - 60 = 420 s: grown
    assert s.floor() == (5, 2)
    now[0] += 10**6  # past the horizon: the last period's pools
    assert s.floor() == (5, 2)
    with pytest.raises(ValueError, match="no periods"):
        Schedule({"recommended": None, "periods": []}, 60.0)
    # a plan made in a zone reads its times of day there, wherever it is read back (Tokyo: UTC+9, no DST)
    utc_0830 = 1_780_000_000 - 1_780_000_000 % 86_400 + 8.5 * 3600  # 08:30 UTC on some day
    for tz, want in (("Asia/Tokyo", (8, 3)), ("UTC", (2, 1)), ("America/Santiago", (1, 1))):
        now[0] = utc_0830 + 3 * 60  # 08:33 UTC, 17:33 in Tokyo, 04:33 or 05:33 in Santiago
        assert Schedule(dict(plan, timezone=tz), interval_s=60.0, wall=lambda: now[0]).floor() == want, tz
    with pytest.raises(ValueError, match="unknown time zone 'Mars/Olympus'"):
        Schedule(dict(plan, timezone="Mars/Olympus"), 60.0)
    bad = _write(tmp_path, "bad.json", "{\"periods\": [{\"start_s\": 0}], \"recommended\": {}}")
    with pytest.raises(ValueError, match="not a `pdserve plan --forecast` result"):
        Schedule.load(bad, 60.0)
