"""The planning study of BENCHMARKS.md, small: every row is found, the scaled fleet follows the load."""

from __future__ import annotations

from pathlib import Path

from services.planner.study import run_study

ROOFLINE = Path(__file__).parents[2] / "shared/sim/profiles/roofline-llama3-70b-tp8-h100.json"


def test_small_study_the_scaled_fleet_pays_for_less_than_the_peak_and_meets_the_slos():
    r = run_study(str(ROOFLINE), rate=20.0, duration_s=1200.0, search_s=120.0, slo_ttft_ms=4000, slo_tpot_ms=40,
                  attainment=95.0, max_workers=40, colocated_chunks=(2048,), interval_s=30.0, startup_s=60.0)
    rows = r["rows"]
    planned, scaled, static = rows["planned"], rows["planned, scaled over the hour"], rows["static 1:1"]
    assert planned and scaled and static
    assert scaled["max_gpus"] >= planned["gpus"] > scaled["gpus"]  # it starts at the peak's size, then shrinks
    assert scaled["scaling"]["changes"] > 2 and len({(p, d) for _, p, d in scaled["scaling"]["log"]}) > 2
    for row in (planned, scaled, static):
        assert row["attainment_pct"] >= 95.0, row  # both SLOs together, over the whole run
    ratios = r["goodput_per_gpu_ratios"]
    assert ratios["planned, scaled over the hour_vs_static 1:1"] > ratios["planned_vs_static 1:1"] >= 1.0
