"""Simulator vs reality on this machine (the issue's acceptance check, small and bounded): a real
`pdserve up` + `pdserve bench` against the simulator on a profile measured and calibrated in the
same run — chat, long-doc and the interference mix, each at two loads. Every metric must be within
15%; the whole table is printed (and logged) before the assertion, so a failure shows all of it."""

from __future__ import annotations

import json
import os

import pytest

TOLERANCE = 0.15


@pytest.mark.slow
@pytest.mark.timeout(1200)  # ~9.5 min on an AVX2-only Zen 1 (its cases stretched ×3), ~3 on the AVX-512 host
@pytest.mark.xfail(strict=False, reason="issue 15 is open: the real stack is not repeatable to 15% on these shared 2 "
                   "cores. Three runs of the same seeded cases on fresh stacks (2026-12-04) spread by more than 15% (max "
                   "vs min) in 15 of the 30 cells; on the AVX2 Zen 1 (2026-12-05, cases stretched ×3) the simulator "
                   "missed 10-17 of 30 cells a run, in both directions (BENCHMARKS.md); the table is printed either way")
def test_simulated_latencies_match_a_real_run(tmp_path):
    from services.planner.accuracy import ASSERTED, compare, format_table

    result = compare()
    table = format_table(result)
    print("\nsim / real (error)\n" + table)
    (tmp_path / "accuracy.json").write_text(json.dumps(result, indent=1))
    if os.environ.get("PDSERVE_ACCURACY_OUT"):
        with open(os.environ["PDSERVE_ACCURACY_OUT"], "w") as f:
            json.dump(result, f, indent=1)
    misses = [f"{row['case']} {key}: sim {v['sim']:.4g} vs real {v['real']:.4g} ({v['error']:+.0%})"
              for row in result["rows"] for key, v in row.items() if key in ASSERTED and abs(v["error"]) > TOLERANCE]
    assert not misses, f"{len(misses)} metrics off by more than {TOLERANCE:.0%}:\n" + "\n".join(misses)
