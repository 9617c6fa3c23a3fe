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


def test_a_slower_host_stretches_the_runs_so_its_prefill_pool_is_as_busy():
    import dataclasses
    import math

    from services.planner.accuracy import CASES
    from services.planner.calibrate import host_scale
    from shared.sim.cost import PrefillFit

    n = 256
    here = PROFILE.prefill_time(n, n * n / 2, 1)
    reference = {"prefill": {"points": [{"seqs": 1, "tokens": n, "offset": 0, "seconds": here}]}}
    assert host_scale(PROFILE, reference) == pytest.approx(1.0)
    p = PROFILE.prefill
    slow = dataclasses.replace(PROFILE, prefill=PrefillFit(*(8 * x for x in dataclasses.astuple(p))))
    assert host_scale(slow, reference) == pytest.approx(math.sqrt(8))
    fast = dataclasses.replace(PROFILE, prefill=PrefillFit(*(x / 2 for x in dataclasses.astuple(p))))
    assert host_scale(fast, reference) == 1.0  # a faster host runs the cases as they are
    # nor does one a few percent slower: its cases (and their arrivals, seeded by the rate) are the same
    noisy = dataclasses.replace(PROFILE, prefill=PrefillFit(*(1.05 * x for x in dataclasses.astuple(p))))
    assert host_scale(noisy, reference) == 1.0

    s = math.sqrt(8)
    for case in CASES:
        scaled = case.scaled(s)
        assert scaled.output_len == case.output_len  # answers keep their length: ITL needs their gaps
        mean = sum(case.input_len) / 2
        mean_scaled = sum(scaled.input_len) / 2
        if math.isfinite(case.rate):  # prompt tokens arriving a second, × the slowdown: as busy
            assert scaled.rate * mean_scaled * s * s == pytest.approx(case.rate * mean, rel=0.02)
        else:
            assert scaled.duration_s == pytest.approx(case.duration_s * s)
            assert scaled.long_interval_s == pytest.approx(case.long_interval_s * s)
            assert sum(scaled.long_len) * s == pytest.approx(sum(case.long_len), rel=0.02)


def test_a_step_is_charged_by_the_drafts_it_verifies():
    """Acceptance alike across the calibration's requests (no slope to read): the engine's own cost
    of a row stands in; a workload whose steps verify more drafts gets longer event gaps."""
    import dataclasses

    runs = _runs()
    short = dataclasses.replace(runs[0], drafts=(1.5,) * 4)  # 1.5 drafts a step, 1 of them kept (τ 2)
    runs = [short, *runs[1:]]
    engine = dataclasses.replace(PROFILE, draft_row_s=0.004)
    p = calibrate(engine, runs)
    assert p.spec_token_s == pytest.approx(0.004) and p.drafts_per_event == pytest.approx(1.5)

    def gap(profile):  # an event's gap at batch 1: the step per token × tokens an event
        return profile.decode_time(1, 148) * profile.tokens_per_event

    more = p.with_tokens_per_event(2.0, drafts=3.5)  # as many kept, 2 more verified a step
    assert gap(more) - gap(p) == pytest.approx(2 * 0.004)
    assert gap(p.with_tokens_per_event(2.5)) - gap(p) == pytest.approx(0.5 * 0.004)  # drafts unknown: one a kept token
    assert calibrate(PROFILE, runs).spec_token_s == 0.0  # no engine measure either: the step as it was


def test_a_slope_across_requests_is_read_from_their_drafts():
    import dataclasses

    runs = _runs()
    drafts = (0.5, 1.0, 2.0, 3.0)
    points = tuple((2.0, 0.012 + 0.003 * d) for d in drafts)  # τ alike, the verified drafts not
    runs[0] = dataclasses.replace(runs[0], per_request=points, drafts=drafts)
    p = calibrate(dataclasses.replace(PROFILE, draft_row_s=0.010), runs)
    assert p.spec_token_s == pytest.approx(0.003)  # the served slope, not the engine's


def test_a_recorded_calibration_is_reproduced_from_the_runs_it_records():
    """`recalibrate` undoes what `calibrate` scaled (the engine's prefill fit) and calibrates again from
    the served runs a profile records: a profile it gives comes back the same, and the parts that
    `calibrate` has not changed since the runs were recorded come back as recorded."""
    import json
    from pathlib import Path

    from services.planner.calibrate import recalibrate
    from shared.sim.cost import Profile

    results = Path(__file__).parents[2] / "benchmarks/results"
    runs = json.loads((results / "sim-accuracy-avx2.json").read_text())["runs"][3:]
    runs += json.loads((results / "sim-accuracy-amx.json").read_text())["runs"]
    for run in runs:
        recorded = Profile.from_json(run["profile"])
        again = recalibrate(recorded)
        once, twice = again.to_json(), recalibrate(again).to_json()
        for key, value in once.items():
            if key != "meta":
                _same(value, twice[key], key)
        for key in ("prefill", "request_overhead_s", "unlent", "spec_token_s", "tokens_per_event", "itl_shape"):
            _same(run["profile"][key], once[key], key)


def _same(a, b, key: str) -> None:
    import json
    import math

    assert json.dumps(a) == json.dumps(b) or all(
        math.isclose(x, y, rel_tol=1e-9) for x, y in zip(_floats(a), _floats(b), strict=True)), key


def _floats(v):
    if isinstance(v, dict):
        return [x for k in sorted(v) for x in _floats(v[k])]
    if isinstance(v, list | tuple):
        return [x for item in v for x in _floats(item)]
    return [v]


def test_a_wider_run_bends_the_decode_fit_to_what_a_chats_batch_costs():
    """A fit through batches of 1 and ~3 alone extrapolates their slope; the wider run (8 streams of
    96-token answers) holds more sequences a step and costs less each than that slope says: with it,
    the fit's per-sequence part comes down and its step at the wider run's served batch nears that
    run's gap. A run recorded without it (4 runs) calibrates as before."""
    gap = 0.015
    runs = _runs(gap=gap)
    without = calibrate(PROFILE, runs)
    wider = CalibrationRun(8, 128, 96, 2.5 * gap, runs[0].ttft_p50_s, per_request=((2.0, 2.5 * gap),) * 10)
    with_it = calibrate(PROFILE, [*runs[:3], wider, runs[3]])
    c = with_it.meta["calibration"]
    assert len(c["wide_batches"]) == 2 and len(without.meta["calibration"]["wide_batches"]) == 1
    assert with_it.decode.per_seq_s < without.decode.per_seq_s
    served = c["wide_batches"][1]
    ctx = 128 + 96 // 2
    step = with_it.decode_time(round(served), round(served) * ctx) * with_it.tokens_per_event
    extrapolated = without.decode_time(round(served), round(served) * ctx) * without.tokens_per_event
    assert abs(step - 2.5 * gap) < abs(extrapolated - 2.5 * gap)


def _write_steps(path, since: float) -> None:
    """A decode worker's step log (PDSERVE_STEP_LOG) on 2 cores: steps on one thread cost 9 ms +
    2 ms a sequence + 2 ms a draft row, on two 15 ms + 0.75 ms + 1 ms (+ 3 µs a row and context token
    each: a draft attends over the context too; the two-thread lines as logged before they carried
    `decode_row_ctx`); and what the fit must leave out: a prefill worker's prompt steps, steps from
    before `since`, a line cut short."""
    import itertools
    import json

    lines = []
    for threads, (base, seq, draft) in ((1, (9e-3, 2e-3, 2e-3)), (2, (15e-3, 0.75e-3, 1e-3))):
        for b, d, ctx in itertools.product((1, 2, 3, 5, 8), (0, 1, 3), (100, 400, 900, 1500)):
            rows = b * (1 + d)
            lines.append({"t": since + 1, "s": base + seq * b + draft * b * d + 3e-6 * rows * ctx, "threads": threads,
                          "prompt_seqs": 0, "prompt_rows": 0, "prompt_ctx": 0, "decode_seqs": b,
                          "decode_rows": rows, "decode_ctx": b * ctx} | ({"decode_row_ctx": rows * ctx}
                                                                           if threads == 1 else {}))
    lines.append(dict(lines[0], t=since - 5, s=1.0))  # the warm-up's
    lines.append(dict(lines[0], prompt_seqs=1, prompt_rows=300, s=0.3))  # a prompt's chunk
    path.write_text("\n".join(json.dumps(r) for r in lines) + '\n{"t": 1, "s"')


def test_the_engine_loop_s_time_between_decode_steps_is_what_an_event_adds_to_a_step(tmp_path):
    """`between_decode_steps`: the mean pause between two decode steps back to back in each worker's
    log (the loop's work outside the logged step), not a pause where the engine idled, nor one
    beside a prompt's chunk; `calibrate` adds it to both widths' steps as what an event adds."""
    import json

    from services.planner.calibrate import between_decode_steps, decode_steps

    _write_steps(tmp_path / "steps-7.jsonl", since=1000.0)
    assert between_decode_steps(tmp_path, since=1000.0) is None  # all at one time: no steps back to back
    pauses = [0.001, 0.002, 0.5, 0.0015, 0.001] * 12  # 0.5 s: the engine waited for work
    t, lines = 2000.0, []
    for i, pause in enumerate(pauses):
        t += pause + 0.02
        lines.append({"t": t, "s": 0.02, "threads": 1 + i % 2, "prompt_seqs": 0, "prompt_rows": 0, "prompt_ctx": 0,
                      "decode_seqs": 1, "decode_rows": 2, "decode_ctx": 200, "decode_row_ctx": 400})
    # a prompt's chunk between steps 29 and 30: neither pause beside it counts, nor the one it splits
    lines.insert(30, dict(lines[29], t=lines[29]["t"] + 0.0005, prompt_seqs=1, prompt_rows=64, s=0.0001))
    (tmp_path / "steps-8.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    between = between_decode_steps(tmp_path, since=1500.0)
    counted = [x for i, x in enumerate(pauses) if i not in (0, 30) and x < 0.5]  # the first step has none before it
    assert between == pytest.approx(sum(counted) / len(counted))
    steps = decode_steps(tmp_path, since=0.0, cores=2)
    assert steps["share"]["between_steps_s"] == steps["wide"]["between_steps_s"] == between
    p = calibrate(PROFILE, _runs(gap=0.025), steps)
    assert p.meta["calibration"]["event_overhead_s"] == between


def test_the_engine_s_logged_decode_steps_give_a_fit_per_width(tmp_path):
    """`decode_steps` fits the served decode steps on the engine's share and on the whole host
    apart; `calibrate` makes them the profile's `decode` and `decode_wide`, each with what an event
    adds to a step (the batch-1 run's gap less its logged step), and the lending run's decode
    slowdown is then the width's. A calibration recorded with them calibrates again the same."""
    from services.planner.calibrate import decode_steps, logged_decode_steps, recalibrate, step_fit_error

    _write_steps(tmp_path / "steps-7.jsonl", since=1000.0)
    steps = decode_steps(tmp_path, since=1000.0, cores=2)
    share, wide = steps["share"], steps["wide"]
    assert (share["threads"], wide["threads"]) == (1, 2) and share["steps"] == wide["steps"] == 60
    assert (share["base_s"], share["per_seq_s"], share["per_draft_s"], share["per_ctx_token_s"]) == \
        pytest.approx((9e-3, 2e-3, 2e-3, 3e-6))
    assert (wide["base_s"], wide["per_seq_s"], wide["per_draft_s"]) == pytest.approx((15e-3, 0.75e-3, 1e-3))
    # the fits read the steps they were fitted on exactly, and steps 10% slower 10% short
    logged = logged_decode_steps(tmp_path, since=1000.0)
    assert len(logged) == 120  # not the prompt's chunk, nor the warm-up's step, nor the cut line
    for slower, error in ((1.0, 0.0), (1.1, 1 / 1.1 - 1)):
        read = step_fit_error(steps, [dict(r, s=r["s"] * slower) for r in logged])
        assert {w: (e["steps"], e["error"]) for w, e in read.items()} == \
            {"share": (60, pytest.approx(error)), "wide": (60, pytest.approx(error))}
    assert step_fit_error(steps, [dict(r, threads=4) for r in logged]) is None
    assert decode_steps(tmp_path, since=1000.0, cores=1) is None  # one core: one width
    assert decode_steps(tmp_path, since=2000.0, cores=2) is None  # none since

    runs = _runs(gap=0.025)  # batch 1, 1 draft a step (τ 2), 148 tokens of context: a 13.4 ms step
    p = calibrate(PROFILE, runs, steps)
    overhead = 0.025 - (9e-3 + 2e-3 + 2e-3 + 3e-6 * 2 * 148)  # two rows over the context
    assert p.meta["calibration"]["event_overhead_s"] == pytest.approx(overhead)
    assert p.unlent[1] == 1.0 and p.spec_token_s == pytest.approx(2e-3) and p.spec_token_wide_s == pytest.approx(1e-3)
    assert p.spec_ctx_token_s == pytest.approx(3e-6)
    assert p.decode_time(1, 148) * 2 == pytest.approx(0.025)  # batch 1 on its share meets its event gap
    # eight streams, a draft each, on both cores: 15 + 8 × (0.75 + 1) ms + their rows' context + the event's, ÷ 2 tokens
    assert p.decode_time(8, 8 * 148, wide=True) * 2 == pytest.approx(
        15e-3 + 8 * 1.75e-3 + 3e-6 * 2 * 8 * 148 + overhead)
    # a long document's drafts cost more: at 3 drafts an event (τ 3) and 1,000 tokens of context, 4 rows read it
    doc = p.with_tokens_per_event(3.0, 3.0)
    assert doc.decode_time(1, 1000) * 3 == pytest.approx(9e-3 + 2e-3 + 3 * 2e-3 + 3e-6 * 4 * 1000 + overhead)
    assert p.wide_decode_ratio(1, 148) > 1 > p.wide_decode_ratio(8, 8 * 148)
    again = recalibrate(p)
    assert again.decode_wide == p.decode_wide and again.decode == p.decode and again.unlent == p.unlent
