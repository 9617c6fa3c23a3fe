"""Simulator vs reality on this machine (the issue's acceptance check, small and bounded): a real
`pdserve up` + `pdserve bench` against the simulator on a profile measured and calibrated in the
same run — chat, long-doc and the interference mix, each at two loads. Every metric must be within
15%; the whole table is printed (and logged) before the assertion, so a failure shows all of it.

Only the 15% assertion is the expected failure: a run that crashes, or cannot calibrate, fails.
What guards the simulator against a change that makes it worse is tests/sim/test_accuracy_replay.py:
the recorded real runs, simulated again."""

from __future__ import annotations

import json
import os

import pytest

TOLERANCE = 0.15


@pytest.mark.slow
@pytest.mark.serial  # it times the stack: nothing else may run beside it
@pytest.mark.timeout(1200)  # 7-9.5 min on an AVX2-only Zen 1 (its cases stretched ×3), ~3 on the AVX-512 host
@pytest.mark.xfail(raises=AssertionError, strict=False,
                   reason="issue 15 is open: the real stack is not repeatable to 15% on these shared 2 cores. Three "
                   "runs of the same seeded cases on fresh stacks (2026-12-04) spread by more than 15% (max vs min) in "
                   "15 of the 30 cells; on the AVX2 Zen 1 (2026-12-05, cases stretched ×3) the simulator missed 9-17 "
                   "of 30 cells a run, in both directions; on an AMX Xeon (2026-12-06) 1-9 of 30, and 2-7 since the "
                   "long-doc cases answer 32-128 tokens (BENCHMARKS.md); the table is printed either way")
def test_simulated_latencies_match_a_real_run(tmp_path):
    from services.planner.accuracy import compare, format_agreement, format_table, misses

    result = compare()
    print("\nsim / real (error)\n" + format_table(result) + "\n" + format_agreement(result))
    (tmp_path / "accuracy.json").write_text(json.dumps(result, indent=1))
    if os.environ.get("PDSERVE_ACCURACY_OUT"):
        with open(os.environ["PDSERVE_ACCURACY_OUT"], "w") as f:
            json.dump(result, f, indent=1)
    off = misses(result, TOLERANCE)
    assert not off, f"{len(off)} metrics off by more than {TOLERANCE:.0%}:\n" + "\n".join(off)
