"""The planning study of BENCHMARKS.md, small: every row is found, the scaled fleet follows the load."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.planner.study import run_study

ROOFLINE = Path(__file__).parents[2] / "shared/sim/profiles/roofline-llama3-70b-tp8-h100.json"


def test_small_study_the_scaled_fleet_pays_for_less_than_the_peak_and_meets_the_slos():
    tp4 = ROOFLINE.with_name("roofline-llama3-70b-tp4-h100.json")
    r = run_study(str(ROOFLINE), rate=20.0, duration_s=1200.0, search_s=120.0, slo_ttft_ms=4000, slo_tpot_ms=40,
                  attainment=95.0, max_workers=60, colocated_chunks=(2048,), interval_s=30.0, startup_s=60.0,
                  prefill_profiles=(str(tp4),), prefill_inflights=(2,), decode_profiles=(str(tp4),),
                  variants=((0.2, 30.0, "profile"), (0.2, 30.0, "profile", "line")))
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
