"""The planning study of BENCHMARKS.md, small: every row is found, the scaled fleet follows the load."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.planner.study import _schedule_scaler, _variant, run_study, trace

ROOFLINE = Path(__file__).parents[2] / "shared/sim/profiles/roofline-llama3-70b-tp8-h100.json"


def test_small_study_the_scaled_fleet_pays_for_less_than_the_peak_and_meets_the_slos():
    tp4 = ROOFLINE.with_name("roofline-llama3-70b-tp4-h100.json")
    r = run_study(str(ROOFLINE), rate=20.0, duration_s=1200.0, search_s=120.0, slo_ttft_ms=4000, slo_tpot_ms=40,
                  attainment=95.0, max_workers=60, colocated_chunks=(2048,), interval_s=30.0, startup_s=60.0,
                  prefill_profiles=(str(tp4),), prefill_inflights=(2,), decode_profiles=(str(tp4),),
                  variants=((0.2, 30.0, "profile"), (0.2, 30.0, "profile", "line")), jobs=2)  # rows in 2 processes
    rows = r["rows"]
    planned, scaled, static = rows["planned"], rows["planned, scaled over the hour"], rows["static 1:1"]
    assert planned and scaled and static
    # the planned split's pools each on TP8 or TP4, 2 jobs a prefill worker; the baseline on TP8 with
    # the profile's 8, and with the planned split's number too
    assert planned["prefill_profile"] in (None, tp4.stem) and planned["prefill_inflight"] == 2
    assert planned["decode_profile"] in (None, tp4.stem)
    assert static["prefill_profile"] is None and static["decode_profile"] is None
    assert static["prefill_inflight"] is None
    assert rows[f"static 1:1, {planned['prefill_inflight']} jobs a prefill worker"]["attainment_pct"] >= 95.0
    prefill_gpus, decode_gpus = (4 if planned[f"{pool}_profile"] else 8 for pool in ("prefill", "decode"))
    assert planned["gpus"] == pytest.approx(planned["prefill"] * prefill_gpus + planned["decode"] * decode_gpus)
    assert (scaled["prefill_profile"], scaled["decode_profile"]) == (planned["prefill_profile"],
                                                                     planned["decode_profile"])
    assert scaled["max_gpus"] >= planned["gpus"] > scaled["gpus"]  # it starts at the peak's size, then shrinks
    assert scaled["scaling"]["changes"] > 2 and len({(p, d) for _, p, d in scaled["scaling"]["log"]}) > 2
    assert sum(w[1] for w in scaled["scaling"]["slo_by_window"]) == scaled["requests"]  # where the misses are
    variant = rows["planned, scaled over the hour, sized from the profile (headroom 0.2, startup 30 s)"]
    assert variant["scaling"]["sizer"] == "profile" and variant["scaling"]["headroom"] == 0.2
    assert variant["scaling"]["curvature"] and variant["scaling"]["down_after"] == [3, 1]
    line = rows["planned, scaled over the hour, sized from the profile (headroom 0.2, startup 30 s, a line forecast)"]
    assert not line["scaling"]["curvature"] and line["scaling"]["down_after"] == [3, 3]
    for row in (planned, scaled, static):
        assert row["attainment_pct"] >= 95.0, row  # both SLOs together, over the whole run
    ratios = r["goodput_per_gpu_ratios"]
    assert ratios["planned, scaled over the hour_vs_static 1:1"] > ratios["planned_vs_static 1:1"] >= 1.0


def test_the_study_runs_a_fleet_resized_by_a_plan_through_a_forecast_of_its_load(tmp_path):
    """`--schedule`: `pdserve plan --forecast` on the trace's swing (each 150 s's mean rate, the mix
    from a steady stretch of the same shape), then that schedule on the study's own trace."""
    import argparse
    import json
    import math

    from services.planner.plan import PlanSpec, add_plan_args
    from services.planner.schedule import plan_forecast
    from services.planner.study import SCHEDULED
    from shared.sim.cost import load_profile
    from shared.sim.workload import mooncake_shaped_trace

    rate, hour = 20.0, 1200.0
    rows = ["time,rate"]
    for a in range(0, int(hour), 150):  # the mean of rate·(1 + ½ sin) over each 150 s
        mean = rate + rate / 2 * (math.cos(2 * math.pi * a / hour) - math.cos(2 * math.pi * (a + 150) / hour)) \
            * hour / (2 * math.pi * 150)
        rows.append(f"{a},{mean:.2f}")
    (tmp_path / "f.csv").write_text("\n".join(rows) + "\n")
    (tmp_path / "mix.jsonl").write_text("".join(json.dumps(r) + "\n" for r in mooncake_shaped_trace(120.0, rate, 5)))
    p = argparse.ArgumentParser()
    add_plan_args(p)
    args = p.parse_args(["--forecast", str(tmp_path / "f.csv"), "--trace", str(tmp_path / "mix.jsonl"),
                         "--slo-ttft-p90-ms", "4000", "--slo-itl-p90-ms", "40", "--slo-attainment", "95",
                         "--budget", "60", "--modes", "disaggregated", "--kv-path", "network", "--startup-s", "60"])
    spec = PlanSpec(4000, 40, 60, ("disaggregated",), kv_path="network", attainment_pct=95.0)
    plan = plan_forecast(args, load_profile(ROOFLINE), spec, {}, {})
    assert plan["verified"]["meets"], plan["verified"]["periods"]
    peak = plan["recommended"]
    n = max(peak["prefill"], peak["decode"])
    static = {"prefill": n, "decode": n, "chunk_budget": None, "prefill_inflight": None}
    r = run_study(str(ROOFLINE), rate=rate, duration_s=hour, search_s=120.0, slo_ttft_ms=4000, slo_tpot_ms=40,
                  attainment=95.0, max_workers=60, interval_s=30.0, configs_from={"rows": {"static 1:1": static,
                                                                                            "planned": peak}},
                  schedule=plan, variants=(((0.0, 0.05), 60.0, "profile", "schedule"),))  # decode: 5% headroom
    row = r["rows"][SCHEDULED]
    assert row["scaling"]["schedule"] and row["scaling"]["changes"] >= 2
    assert row["gpus"] < peak["gpus"] < row["max_gpus"] + 1e-9  # it holds the peak's fleet only at the peak
    assert row["attainment_pct"] >= 95.0, row["slo_attainment"]
    assert r["goodput_per_gpu_ratios"][f"{SCHEDULED}_vs_static 1:1"] > 1.0
    # the forecaster with the schedule as its floor holds at least the schedule's pools at every decision
    floored = r["rows"]["planned, scaled over the hour, sized from the profile (headroom 0,0.05, startup 60 s, "
                        "the forecast plan’s schedule as a floor)"]
    assert tuple(floored["scaling"]["headroom"]) == (0.0, 0.05)
    floor = _schedule_scaler(plan, 30.0).floor
    assert floored["scaling"]["changes"] >= 2 and floored["attainment_pct"] >= 95.0
    for t, p, d in floored["scaling"]["log"]:
        assert p >= floor(t)[0] and d >= floor(t)[1], (t, p, d, floor(t))
    with pytest.raises(argparse.ArgumentTypeError):
        _variant("0.1:60:schedule:line")  # the flags in their order: sizer, line, schedule, season
    with pytest.raises(argparse.ArgumentTypeError):
        _variant("0.1:60:season:line")
    assert _variant("0.1:60:profile:line:season") == (0.1, 60.0, "profile", "line", "season")
    assert _variant("0.02,0.08:120:profile") == ((0.02, 0.08), 120.0, "profile")  # each pool its own headroom
    with pytest.raises(argparse.ArgumentTypeError, match="PREFILL,DECODE"):
        _variant("0.02,0.08,0.1:120")


def test_a_study_of_two_days_measures_the_second_where_a_fleet_that_knows_the_swing_s_period_meets_the_slos():
    """`days=2`: every row on the second day (the first a warm-up: the resized fleets start the day as
    they ended the last, not at the peak's size). On this small trace the swing is steep for a minute's
    decisions (±50% over 10 minutes): the line lags the rise the day starts with, while the forecaster
    told the period (`:season`) has seen it the day before."""
    static = {"prefill": 8, "decode": 8, "chunk_budget": None, "prefill_inflight": None}
    planned = {"prefill": 7, "decode": 2, "chunk_budget": None, "prefill_inflight": None}
    hour = 600.0
    r = run_study(str(ROOFLINE), rate=10.0, duration_s=hour, search_s=120.0, slo_ttft_ms=4000, slo_tpot_ms=40,
                  attainment=95.0, max_workers=40, interval_s=30.0, startup_s=60.0, headroom=(0.02, 0.08),
                  configs_from={"rows": {"static 1:1": static, "planned": planned}},
                  variants=(((0.02, 0.08), 60.0, "profile", "season"),), days=2, jobs=2)
    rows = r["rows"]
    second = sum(1 for q in trace(10.0, hour, 0, days=2) if q.arrival_s >= hour)
    assert r["days"] == 2 and {row["requests"] for row in rows.values()} == {second}
    assert rows["static 1:1"]["gpus"] == pytest.approx(16 * 8)  # a fixed fleet: held all day
    line = rows["planned, scaled over the hour, sized from the profile"]
    season = rows["planned, scaled over the hour, sized from the profile (headroom 0.02,0.08, startup 60 s, the "
                  "swing’s period known)"]
    assert line["scaling"]["season_s"] is None and season["scaling"]["season_s"] == hour
    assert season["attainment_pct"] >= 95.0 > line["attainment_pct"], (season["slo_attainment"],
                                                                        line["slo_attainment"])
    assert season["gpus"] < rows["planned"]["gpus"]
    with pytest.raises(ValueError, match="one day for a schedule"):
        run_study(str(ROOFLINE), rate=10.0, duration_s=hour, search_s=120.0, slo_ttft_ms=4000, slo_tpot_ms=40,
                  attainment=95.0, max_workers=40, configs_from={"rows": {}}, schedule={"periods": []}, days=2)


def test_the_searches_in_processes_of_their_own_find_what_one_process_finds():
    """The study's searches (the planned split's on each pairing of profiles, then static 1:1's and
    colocated's) in 2 processes: the same configurations, and the same trials in the same order."""
    from dataclasses import replace

    from services.planner.plan import Planner, PlanSpec
    from services.planner.study import _search, busiest, trace
    from shared.sim.cost import load_profile

    tp4 = ROOFLINE.with_name("roofline-llama3-70b-tp4-h100.json")
    search = busiest(trace(10.0, 240.0, 0), 60.0)
    spec = PlanSpec(4000, 40, 30, modes=("disaggregated",), kv_path="network", attainment_pct=95.0,
                    prefill_inflights=(2,))

    def searched(jobs: int):
        planner = Planner(load_profile(ROOFLINE), spec, lambda: [replace(r) for r in search], 40,
                          {tp4.stem: load_profile(tp4)}, {})
        found, on = _search(planner, spec, 30, (2048,), jobs)
        return found, on, [(key, t.gpus, t.ttft_p90_ms) for key, t in planner.trials.items()]

    one, two = searched(1), searched(2)
    assert one[0]["planned"] and one[0]["static 1:1"] and one[0]["static 1:1, 2 jobs a prefill worker"]
    assert one == two
