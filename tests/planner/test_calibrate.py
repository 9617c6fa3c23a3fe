"""Calibration arithmetic on made-up runs whose answers are known (no stack: fast)."""

from __future__ import annotations

import pytest

from services.planner.calibrate import CalibrationRun, LendingRun, calibrate
from tests.sim.test_simulator import PROFILE


def _runs(*, s_p=0.5, overhead=0.08, unlent=(2.0, 1.25), handoff=0.01, gap=0.015):
    def ttft(n):  # a batch-1 prompt's TTFT with the decode worker idle (its cores lent)
        return overhead + s_p * PROFILE.prefill_time(n, n * n / 2, 1)

    kv = sum(PROFILE.transfer_time("shm", 8 * PROFILE.limits.kv_bytes_per_block))  # 128 tokens: 8 blocks
    alike = ((2.0, gap),) * 4  # every request the same acceptance: no speculative slope to read
    return [
        CalibrationRun(1, 128, 40, gap, ttft(128), per_request=alike, first_gap_s=gap + kv + handoff),
        CalibrationRun(1, 768, 12, 1.5 * gap, ttft(768), per_request=((2.0, 1.5 * gap),) * 3),
        CalibrationRun(4, 128, 40, 2 * gap, ttft(128), per_request=((2.0, 2 * gap),) * 8),
        LendingRun(((768, overhead + unlent[0] * s_p * PROFILE.prefill_time(768, 768 * 768 / 2, 1)),) * 4,
                   gap_prefilling_s=unlent[1] * 0.02, gap_alone_s=0.02),
    ]


def test_calibration_reads_the_lending_and_the_handoff():
    p = calibrate(PROFILE, _runs())
    c = p.meta["calibration"]
    assert c["prefill_slowdown"] == pytest.approx(0.5)
    assert p.request_overhead_s == pytest.approx(0.08)
    assert p.unlent == pytest.approx((2.0, 1.25))
    assert p.handoff_s == pytest.approx(0.01)
    assert p.tokens_per_event == pytest.approx(2.0)
    assert p.decode_time(1, 128 + 40 // 2) * 2 == pytest.approx(0.015)  # batch 1 meets its event gap


def test_lending_that_speeds_nothing_is_no_factor_below_one():
    runs = _runs(unlent=(0.8, 0.9), handoff=-0.005)  # noise: beside the streams faster than alone
    p = calibrate(PROFILE, runs)
    assert p.unlent == (1.0, 1.0) and p.handoff_s == 0.0
