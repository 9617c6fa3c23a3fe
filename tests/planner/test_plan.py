"""`pdserve plan` on a small synthetic profile: the answer meets the SLOs, fits the budget, and is
the cheapest the search saw."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from services.planner.plan import Planner, PlanSpec
from shared.sim.cost import DecodeFit, EngineLimits, LinearFit, PrefillFit, Profile, TransferFit
from shared.sim.workload import poisson_requests

PROFILE = Profile(
    prefill=PrefillFit(base_s=0.01, per_token_s=2e-4, per_attn_pair_s=1e-8, per_seq_s=0.0),
    decode=DecodeFit(base_s=0.01, per_seq_s=1e-3, per_ctx_token_s=2e-6),
    transfer={"shm": TransferFit(LinearFit(1e-3, 1e-10), LinearFit(1e-3, 1e-10))},
    limits=EngineLimits(num_kv_blocks=4096, max_num_seqs=32, max_num_batched_tokens=512),
)


def _planner(spec, name="long-doc", rate=6.0, n=150):
    reqs = list(poisson_requests(name, rate, 0, num_requests=n, output_tokens=(16, 48)))
    return Planner(PROFILE, spec, lambda: [replace(r) for r in reqs])


def test_plan_meets_the_slos_within_the_budget_and_is_cheapest_seen():
    spec = PlanSpec(slo_ttft_p90_ms=1500, slo_itl_p90_ms=40, budget=16)
    planner = _planner(spec)
    result = planner.plan()
    rec = result["recommended"]
    assert rec is not None, result["rejected"]
    assert rec["workers"] <= 16 and rec["ttft_p90_ms"] <= 1500 and rec["itl_p90_ms"] <= 40
    feasible = [t for t in planner.trials.values() if t.meets(spec) and t.workers <= spec.budget]
    assert rec["workers"] == min(t.workers for t in feasible)
    assert all(r["why_not"] for r in result["rejected"])
    # long prompts, short answers: the plan's prefill pool is the bigger one
    if rec["mode"] == "disaggregated":
        assert rec["prefill"] >= rec["decode"]


def test_searches_in_processes_of_their_own_give_the_single_process_answer():
    """`--jobs`: each mode's and chunk budget's search in a forked process (one search: its two pools'
    bisections); the plan, its runner-ups, the rejected configurations and the trials kept are the
    ones one process finds."""
    spec = PlanSpec(slo_ttft_p90_ms=1500, slo_itl_p90_ms=40, budget=16, modes=("disaggregated", "colocated"),
                    chunk_budgets=(256, 512))
    alone, forked = _planner(spec), _planner(spec)
    assert len(alone.searches()) == 4
    one, four = alone.plan(), forked.plan(jobs=4)
    assert one["recommended"] is not None
    assert json.dumps(four, sort_keys=True) == json.dumps(one, sort_keys=True)
    assert list(forked.trials) == list(alone.trials)
    assert forked.sized == alone.sized
    # one search (disaggregated, one chunk budget): its two pools' bisections at once, the same answer
    one_search = replace(spec, modes=("disaggregated",), chunk_budgets=(512,))
    alone, forked = _planner(one_search), _planner(one_search)
    one, two = alone.plan(), forked.plan(jobs=2)
    assert one["recommended"]["mode"] == "disaggregated" and len(alone.trials) > 4
    assert json.dumps(two, sort_keys=True) == json.dumps(one, sort_keys=True)
    assert list(forked.trials) == list(alone.trials)


def test_plan_says_so_when_the_budget_is_too_small():
    result = _planner(PlanSpec(slo_ttft_p90_ms=300, slo_itl_p90_ms=15, budget=3)).plan()
    assert result["recommended"] is None
    assert result["rejected"]


def test_a_gpu_budget_rejects_an_answer_over_it_however_few_workers_it_has():
    """`--budget-gpus`: workers of 4 GPUs each (a TP4 group, say). The answer within the workers'
    budget but over the GPUs' is rejected, and says why; at exactly its GPUs it stands."""
    import argparse

    from services.planner.plan import worker_budget

    four = replace(PROFILE, limits=replace(PROFILE.limits, gpus_per_worker=4))
    reqs = list(poisson_requests("long-doc", 6.0, 0, num_requests=150, output_tokens=(16, 48)))
    spec = PlanSpec(slo_ttft_p90_ms=1500, slo_itl_p90_ms=40, budget=16, modes=("disaggregated",))

    def plan(gpu_budget):
        return Planner(four, replace(spec, gpu_budget=gpu_budget), lambda: [replace(r) for r in reqs]).plan()

    free = plan(None)["recommended"]
    assert free is not None and free["gpus"] == pytest.approx(4 * free["workers"]) and free["workers"] < spec.budget
    exact = plan(free["gpus"])
    assert exact["recommended"] == free and exact["gpu_budget"] == free["gpus"]
    tight = plan(free["gpus"] - 1)
    assert tight["recommended"] is None
    assert any(r["why_not"] == f"{free['gpus']:g} GPUs > GPU budget {free['gpus'] - 1:g}" for r in tight["rejected"])
    # the CLI: workers at most what the GPUs hold of the smallest worker, unless --budget says
    args = argparse.Namespace(budget=None, budget_gpus=30.0)
    assert worker_budget(args, [four, PROFILE]) == 30 and worker_budget(args, [four]) == 7
    assert worker_budget(argparse.Namespace(budget=5, budget_gpus=30.0), [four]) == 5
    with pytest.raises(ValueError, match="--budget .workers. or --budget-gpus"):
        worker_budget(argparse.Namespace(budget=None, budget_gpus=None), [four])
    with pytest.raises(ValueError, match="GPU budget must be positive"):
        replace(spec, gpu_budget=0)


def test_attainment_form_of_the_slos():
    spec = PlanSpec(slo_ttft_p90_ms=1500, slo_itl_p90_ms=40, budget=16, modes=("disaggregated",),
                    attainment_pct=95.0)
    planner = _planner(spec)
    t = planner.plan_disaggregated(None)
    assert t is not None and t.summary["goodput"]["attainment_pct"] >= 95.0
    with pytest.raises(ValueError):
        PlanSpec(slo_ttft_p90_ms=0, slo_itl_p90_ms=40, budget=4)


def test_plan_cli(tmp_path, capsys):
    from services.cli import main as pdserve
    from tests.services.test_presets import DryRun

    out = tmp_path / "plan.json"
    proc = subprocess.run([sys.executable, "-m", "services.cli", "plan", "--workload", "chat", "--duration", "40",
                           "--request-rate", "0.3", "--slo-ttft-p90-ms", "5000", "--slo-itl-p90-ms", "1000",
                           "--budget", "4", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "recommended:" in proc.stdout
    data = json.loads(out.read_text())
    assert data["recommended"]["workers"] <= 4
    sized = data["profile_sizer"]  # where the search began: the sizer's counts and the mix they were for
    assert sized["prefill"] >= 1 and sized["decode"] >= 1 and sized["mix"]["prompt_tokens"] > 0
    assert "the profile sizer put it at" in proc.stdout
    if data["recommended"]["mode"] == "disaggregated":  # what `pdserve planner --policy forecast` takes
        cap = data["capacity_rps_per_worker"]
        assert cap["prefill"] > 0 and cap["decode"] > 0 and "--capacity" in proc.stdout
    # a CPU profile's engines share the cores of its host (shared/sim/cores.py), which its meta names
    from shared.sim.cost import load_profile

    assert data["budget"] == 4 and load_profile(None).host_cores() is not None
    assert load_profile(str(Path(__file__).parents[2] / "shared/sim/profiles/"
                            "roofline-llama3-70b-tp8-h100.json")).host_cores() is None
    # a colocated answer on this machine's (CPU) profile comes with the simulator's caveat there
    assert (data["recommended"]["mode"] == "colocated") == ("caveat" in data) == ("note: the simulator's colocated "
                                                                                 "mode" in proc.stdout)
    # how to run it: the command line printed, and the plan file itself, resolve to what was planned
    [run] = [line for line in proc.stdout.splitlines() if line.startswith("run it: ")]
    command, saved = run.removeprefix("run it: ").split("   (or: ")
    assert saved == f"pdserve up --plan {out})"
    rec = data["recommended"]
    for argv, source in ((shlex.split(command)[1:], "flag"), (["up", "--plan", str(out)], f"plan {out.name}")):
        assert pdserve([*argv, "--dry-run"]) == 0
        got = DryRun(capsys.readouterr().out)
        assert got.settings["--mode"] == (rec["mode"], source)
        assert got.settings["--decode"] == (str(rec["decode"]), source)
        if rec["mode"] != "colocated":
            assert got.settings["--prefill"] == (str(rec["prefill"]), source)
        workers = got.workers()
        assert len(workers) == rec["decode"] + (rec["prefill"] if rec["mode"] != "colocated" else 0)


def test_the_search_starts_where_the_profile_sizer_points_and_finds_what_a_blind_search_finds():
    """At 1,000-GPU scale a blind search (doubling from one worker, then bisection) takes a dozen
    simulations a pool; started at the sizer's counts it takes a few, and the answer is the same."""
    from shared.sim.cost import load_profile
    from tests.planner.test_forecast import stationary
    from tests.planner.test_study import ROOFLINE

    reqs = stationary(40.0, 90.0, seed=7)
    spec = PlanSpec(4000, 40, 120, modes=("disaggregated",), kv_path="network", attainment_pct=95.0)
    found = {}
    for seeded in (True, False):
        planner = Planner(load_profile(ROOFLINE), spec, lambda: [replace(r) for r in reqs])
        if not seeded:
            planner.guess = lambda roomy, *pools: (None, None)
        t = planner.plan_disaggregated(None)
        found[seeded] = ((t.config.prefill, t.config.decode), len(planner.trials))
    assert found[True][0] == found[False][0]
    assert found[True][1] * 2 <= found[False][1], found  # here 6 simulations against 13, both finding 16 : 3


def test_plan_tries_the_prefill_pool_on_another_tensor_parallel_group_and_ranks_by_gpus(tmp_path):
    """`--prefill-profile`: the 70B roofline's prefill pool on TP4 as well as TP8 (decode on TP8), each
    with 2 or 8 jobs a prefill worker at once; the answer is the feasible one with the fewest GPUs,
    counted at each pool's own size."""
    from shared.sim.workload import mooncake_shaped_trace
    from tests.planner.test_study import ROOFLINE

    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(row) + "\n" for row in mooncake_shaped_trace(90.0, 40.0, seed=7)))
    out = tmp_path / "plan.json"
    tp4 = ROOFLINE.with_name("roofline-llama3-70b-tp4-h100.json")
    proc = subprocess.run([sys.executable, "-m", "services.cli", "plan", "--trace", str(trace), "--profile",
                           str(ROOFLINE), "--prefill-profile", str(tp4), "--prefill-inflights", "2,8",
                           "--slo-ttft-p90-ms", "4000", "--slo-itl-p90-ms", "40", "--budget", "120",
                           "--modes", "disaggregated", "--kv-path", "network", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    rec, others = data["recommended"], data["runner_ups"]
    assert len(others) == 3  # four searches: {TP8, TP4} × {2, 8} jobs at once, each found a configuration
    found = {(t["prefill_profile"], t["prefill_inflight"]): t for t in [rec] + others}
    assert set(found) == {(None, 2), (None, 8), (tp4.stem, 2), (tp4.stem, 8)}
    for t in found.values():
        gpus_per_prefill = 4 if t["prefill_profile"] else 8
        assert t["gpus"] == pytest.approx(t["prefill"] * gpus_per_prefill + t["decode"] * 8)
        # ITL's p90 is over all gaps: a stream's wait for a decode slot is one of ~180; its mean gap shows it
        assert t["ttft_p90_ms"] <= 4000 and t["itl_p90_ms"] <= 40 and t["tpot_p90_ms"] <= 40
        assert t["gpus"] >= rec["gpus"]
    # a TP4 worker takes twice as long over a prompt: 8 jobs queued in one behind a long prompt wait
    # while another worker frees up, so it needs more of them than one that leaves them in the queue
    assert found[(tp4.stem, 8)]["gpus"] > found[(tp4.stem, 2)]["gpus"]
    assert "GPUs" in proc.stdout and "jobs a prefill worker" in proc.stdout
    # a prefill pool on another tensor-parallel group is not what `pdserve up` runs: said so, not a wrong command
    run = next(line for line in proc.stdout.splitlines() if line.startswith("run it: "))
    if rec["prefill_profile"]:
        assert f"not with pdserve up: its prefill pool was planned on {tp4.stem}" in run
    else:
        assert run.startswith(f"run it: pdserve up --mode disaggregated --prefill {rec['prefill']} --decode "
                              f"{rec['decode']} --max-inflight {rec['prefill_inflight']}")


def test_plan_pairs_each_pool_with_each_of_its_profiles(tmp_path):
    """`--decode-profile` as well: every pairing of the prefill pool's profiles (TP8, TP4) with the
    decode pool's (TP8, TP4) is a search of its own. On the roofline a TP8 decode worker carries more
    streams per GPU within the TPOT SLO (the weights read once a step for more of them), so for either
    prefill pool decode on TP4 costs more GPUs, and the answer is prefill on TP4, decode on TP8."""
    from shared.sim.workload import mooncake_shaped_trace
    from tests.planner.test_study import ROOFLINE

    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(row) + "\n" for row in mooncake_shaped_trace(90.0, 40.0, seed=7)))
    out = tmp_path / "plan.json"
    tp4 = ROOFLINE.with_name("roofline-llama3-70b-tp4-h100.json")
    proc = subprocess.run([sys.executable, "-m", "services.cli", "plan", "--trace", str(trace), "--profile",
                           str(ROOFLINE), "--prefill-profile", str(tp4), "--decode-profile", str(tp4),
                           "--prefill-inflights", "2", "--slo-ttft-p90-ms", "4000", "--slo-itl-p90-ms", "40",
                           "--budget", "120", "--modes", "disaggregated", "--kv-path", "network", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    rec = data["recommended"]
    found = {(t["prefill_profile"], t["decode_profile"]): t for t in [rec] + data["runner_ups"]}
    assert set(found) == {(None, None), (None, tp4.stem), (tp4.stem, None), (tp4.stem, tp4.stem)}
    for (pp, dp), t in found.items():
        assert t["gpus"] == pytest.approx(t["prefill"] * (4 if pp else 8) + t["decode"] * (4 if dp else 8))
        assert t["ttft_p90_ms"] <= 4000 and t["itl_p90_ms"] <= 40 and t["tpot_p90_ms"] <= 40
    for pp in (None, tp4.stem):
        assert found[pp, tp4.stem]["decode"] * 4 > found[pp, None]["decode"] * 8
    assert (rec["prefill_profile"], rec["decode_profile"]) == (tp4.stem, None)
    assert f"decode ({tp4.stem})" in proc.stdout  # a runner-up's decode pool, named
