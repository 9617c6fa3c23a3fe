"""The simulator's invariants on small, exact configurations (no model, no servers: fast)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from shared.sim.cluster import ClosedLoop, Cluster, ClusterConfig, simulate
from shared.sim.cost import DecodeFit, EngineLimits, LinearFit, PrefillFit, Profile, TransferFit, load_profile
from shared.sim.workload import SimRequest, bench_request, poisson_requests, read_trace

PROFILE = Profile(
    prefill=PrefillFit(base_s=0.01, per_token_s=1e-3, per_attn_pair_s=1e-7, per_seq_s=1e-3),
    decode=DecodeFit(base_s=0.02, per_seq_s=2e-3, per_ctx_token_s=1e-5),
    transfer={"shm": TransferFit(LinearFit(1e-3, 1e-10), LinearFit(1e-3, 1e-10))},
    limits=EngineLimits(num_kv_blocks=2048, max_num_seqs=16, max_num_batched_tokens=256),
)


def _requests(n=60, rate=4.0, seed=1, name="chat"):
    return list(poisson_requests(name, rate, seed, num_requests=n))


def _run(config, reqs, **kw):
    cluster = Cluster(PROFILE, config)
    cluster.run(reqs, check_every=kw.pop("check_every", 1), **kw)
    cluster.check_invariants(final=True)  # every request finished, tokens conserved, no blocks held
    return cluster


@pytest.mark.parametrize("mode", ["disaggregated", "colocated", "conditional"])
def test_every_request_finishes_and_tokens_are_conserved(mode):
    reqs = _requests()
    cluster = _run(ClusterConfig(mode=mode, prefill=2, decode=2), reqs)
    rec = cluster.rec
    assert len(rec.arrival) == len(reqs)
    assert sum(rec.tokens) == sum(r.output_tokens for r in reqs)
    summary = cluster.report()
    assert summary["completed"] == summary["sent"] == len(reqs)
    assert summary["total_output_tokens"] == sum(r.output_tokens for r in reqs)
    itl = summary["itl_ms"]
    assert itl["n"] == sum(r.output_tokens - 1 for r in reqs)  # one gap per token after the first


@pytest.mark.parametrize("mode", ["colocated", "conditional"])
def test_speculative_rows_riding_on_chunks_keep_tokens_and_blocks_exact(mode):
    """With speculation (τ 2.5) a decode row riding on a short prompt's chunk keeps τ tokens on
    average (whole tokens, as its blocks allow): every token is still delivered once, and blocks
    stay within a tight budget."""
    spec = replace(PROFILE, tokens_per_event=2.5, drafts_per_event=1.5)
    reqs = _requests(n=40, rate=6.0)
    # pulls of 4 requests: more rows ride on each other's chunks
    cluster = Cluster(spec, ClusterConfig(mode=mode, decode=2, num_kv_blocks=60, decode_pull_batch=4))
    cluster.run(reqs, check_every=1)
    cluster.check_invariants(final=True)
    assert sum(cluster.rec.tokens) == sum(r.output_tokens for r in reqs)
    assert max(w.max_used_blocks for w in cluster.decode_pool) <= 60
    assert any(w.spec_credit for w in cluster.decode_pool)  # rows did ride with their drafts


def test_kv_blocks_never_exceed_the_budget_and_preemption_recovers():
    # 40 blocks per decode worker: a few chat requests fill it, so running sequences get preempted
    config = ClusterConfig(prefill=1, decode=1, num_kv_blocks=40)
    cluster = _run(config, _requests(n=30, rate=50.0))
    decode = cluster.decode_pool[0]
    assert decode.max_used_blocks <= 40
    assert decode.preemptions > 0
    assert sum(cluster.rec.tokens) == sum(cluster.rec.output)


@pytest.mark.parametrize("mode", ["disaggregated", "colocated", "conditional"])
def test_spans_match_step_by_step(mode):
    """Multi-step decode spans are exact: the same finish times as simulating every step (a whole
    request taken by a decode worker joins at the next step, as a decode job does)."""
    reqs = _requests(n=40, rate=3.0)
    fast = _run(ClusterConfig(mode=mode, decode=2, num_kv_blocks=256), [replace(r) for r in reqs])  # preempting
    slow = _run(ClusterConfig(mode=mode, decode=2, num_kv_blocks=256, decode_spans=False), [replace(r) for r in reqs])
    assert sum(w.preemptions for w in fast.decode_pool) > 0
    assert fast.events < slow.events / 2
    for a, b in zip(fast.rec.finish_s, slow.rec.finish_s):
        assert a == pytest.approx(b, rel=1e-9, abs=1e-9)
    assert fast.rec.first_s == pytest.approx(slow.rec.first_s)
    fa, sl = fast.report()["itl_ms"], slow.report()["itl_ms"]
    for q in ("mean", "p50", "p90", "p99"):
        assert fa[q] == pytest.approx(sl[q], rel=0.02), q


def test_deterministic_and_more_workers_lower_latency():
    reqs = _requests(n=80, rate=8.0)
    a = simulate(PROFILE, ClusterConfig(decode=1), [replace(r) for r in reqs])
    b = simulate(PROFILE, ClusterConfig(decode=1), [replace(r) for r in reqs])
    assert a["ttft_ms"] == b["ttft_ms"] and a["itl_ms"] == b["itl_ms"]
    c = simulate(PROFILE, ClusterConfig(prefill=3, decode=3), [replace(r) for r in reqs])
    assert c["ttft_ms"]["p90"] < a["ttft_ms"]["p90"]
    assert c["e2el_ms"]["p90"] < a["e2el_ms"]["p90"]


def test_prefix_cache_hits_on_a_shared_prefix():
    reqs = _requests(n=20, rate=2.0, name="shared-prefix")
    on = simulate(PROFILE, ClusterConfig(), [replace(r) for r in reqs])
    off = simulate(PROFILE, ClusterConfig(prefix_caching=False), [replace(r) for r in reqs])
    assert on["cost"]["prefix_cache"]["hit_tokens"] >= 15 * 1200  # all but those sent before the first was stored
    assert on["ttft_ms"]["p50"] < off["ttft_ms"]["p50"] / 2


@pytest.mark.parametrize("mode, prompt, keys", [("disaggregated", 17, ("k",)), ("colocated", 257, ())])
def test_a_prompt_whose_last_step_is_one_token_gets_its_first_token_from_it(mode, prompt, keys):
    """One token left to compute — the first 16 of 17 cached, or 257 tokens chunked by a 256-token
    budget — looks like a decode step (and may run inside a decode span); it is the request's first
    token all the same. (The 1,000-GPU study's colocated search once ended on 'times out of order'.)"""
    reqs = [SimRequest(2.0 * i, prompt, 12, prefix_keys=keys) for i in range(6)]  # one at a time: a span
    cluster = _run(ClusterConfig(mode=mode, decode=1, prefill=1), reqs)
    rec = cluster.rec
    assert all(0 <= rec.first_s[r] - rec.arrival[r] < 2.0 for r in range(6))
    if keys:
        assert cluster.cache.hit_tokens == 16 * 5


def test_tokens_per_event_groups_token_gaps_into_event_gaps():
    """Speculative decoding delivers ~τ tokens an event: the same token timeline, read as events —
    ITL τ times the token gap, τ times fewer of them; TTFT, TPOT and throughput untouched."""
    reqs = _requests(n=30, rate=2.0)
    one = simulate(PROFILE, ClusterConfig(), [replace(r) for r in reqs])
    two = simulate(replace(PROFILE, tokens_per_event=2.0), ClusterConfig(), [replace(r) for r in reqs])
    for q in ("p50", "p90"):
        assert two["itl_ms"][q] == pytest.approx(2 * one["itl_ms"][q], rel=0.01)
        assert two["ttft_ms"][q] == one["ttft_ms"][q] and two["tpot_ms"][q] == one["tpot_ms"][q]
    assert two["itl_ms"]["n"] == pytest.approx(one["itl_ms"]["n"] / 2, rel=0.01)
    assert two["request_throughput"] == one["request_throughput"]
    with pytest.raises(ValueError, match="tokens_per_event"):
        replace(PROFILE, tokens_per_event=0.5)


def test_itl_shape_spreads_event_gaps_and_leaves_the_rest():
    """A calibrated spread (event gap ÷ mean at equal-mass quantiles) turns one gap g into g·q for each
    q: percentiles move to the shape's, the mean stays; TTFT, TPOT and throughput are untouched."""
    from shared.sim.metrics import ItlHistogram

    h = ItlHistogram()
    h.add(0.010, 100.0)
    shape = (0.5, 0.8, 1.0, 1.2, 1.5)
    wide = h.spread(shape)
    assert wide.n == h.n and wide.total == pytest.approx(h.total)
    assert wide.percentile(10) == pytest.approx(0.005, rel=0.01)
    assert wide.percentile(50) == pytest.approx(0.010, rel=0.01)
    assert wide.percentile(95) == pytest.approx(0.015, rel=0.01)
    reqs = _requests(n=30, rate=2.0)
    flat = simulate(PROFILE, ClusterConfig(), [replace(r) for r in reqs])
    spread = simulate(replace(PROFILE, itl_shape=shape), ClusterConfig(), [replace(r) for r in reqs])
    assert spread["itl_ms"]["p90"] > 1.2 * flat["itl_ms"]["p90"]
    assert spread["itl_ms"]["mean"] == pytest.approx(flat["itl_ms"]["mean"])
    assert spread["tpot_ms"] == flat["tpot_ms"] and spread["ttft_ms"] == flat["ttft_ms"]
    with pytest.raises(ValueError, match="itl_shape"):
        replace(PROFILE, itl_shape=(0.0, 2.0))


def test_a_workloads_acceptance_moves_its_steps_and_time_per_token():
    """More tokens an event: each step longer by `spec_token_s` per sequence per extra token, the time per token
    shorter; the calibration reads that cost from requests' (tokens per event, gap)."""
    from services.planner.calibrate import spec_token_cost

    spec = replace(PROFILE, spec_token_s=0.004)
    for tau in (1.0, 2.0, 3.5):
        moved = spec.with_tokens_per_event(tau)
        for batch in (1, 4):
            event = moved.decode_time(batch, 500) * tau  # one step, τ tokens each sequence
            assert event == pytest.approx(PROFILE.decode_time(batch, 500) + 0.004 * batch * (tau - 1))
        back = moved.with_tokens_per_event(1.0).decode
        assert (back.base_s, back.per_seq_s, back.per_ctx_token_s) == pytest.approx(
            (PROFILE.decode.base_s, PROFILE.decode.per_seq_s, PROFILE.decode.per_ctx_token_s))
    with pytest.raises(ValueError, match="tokens per event"):
        spec.with_tokens_per_event(0.5)
    reqs = _requests(n=5, rate=0.02)  # one at a time: the same batch of one in both
    slow, fast = (simulate(spec.with_tokens_per_event(t), ClusterConfig(), [replace(r) for r in reqs]) for t in (1.5, 3.0))
    assert fast["itl_ms"]["p50"] > slow["itl_ms"]["p50"] and fast["tpot_ms"]["p50"] < slow["tpot_ms"]["p50"]
    points = tuple((t, 0.010 + 0.003 * (t - 1)) for t in (1.2, 1.8, 2.5, 3.1))
    assert spec_token_cost(points) == pytest.approx((0.010, 0.003))
    assert spec_token_cost(((2.0, 0.02), (2.01, 0.03), (2.02, 0.01)))[1] == 0.0  # no spread in τ: no slope


def test_closed_loop_interference_and_itl_window():
    from services.bench.workloads import Workload

    chat = Workload("chat", 0, output_tokens=(8, 16))
    long = Workload("long-doc", 0, prompt_tokens=(600, 800), output_tokens=(4, 8))
    arrivals = [bench_request(long, k, 2.0 + 3 * k) for k in range(3)]
    closed = ClosedLoop(lambda i: bench_request(chat, i, 0.0), concurrency=3, window_s=10.0)
    s = simulate(PROFILE, ClusterConfig(mode="colocated", decode=1), arrivals, closed=closed, itl_from_s=2.0)
    assert s["by_kind"]["long"]["completed"] == 3 and s["by_kind"]["chat"]["completed"] >= 3
    assert s["failed"] == 0


@pytest.mark.parametrize("mode", ["disaggregated", "colocated", "conditional"])
def test_a_closed_loop_starts_at_once(mode):
    """The streams' first requests are served from time 0 (they waited in the queue for the first
    open-loop arrival to wake the workers, and were all alone TTFT: 13 s where 1 was real)."""
    from services.bench.workloads import Workload

    chat = Workload("chat", 0, output_tokens=(8, 16))
    long = Workload("long-doc", 0, prompt_tokens=(600, 800), output_tokens=(4, 8))
    closed = ClosedLoop(lambda i: bench_request(chat, i, 0.0), concurrency=2, window_s=6.0)
    cluster = Cluster(PROFILE, ClusterConfig(mode=mode))
    cluster.run([bench_request(long, 0, 5.0)], closed)
    cluster.check_invariants(final=True)
    rec = cluster.rec
    alone = PROFILE.prefill_time(sum(rec.prompt[:2]), sum(n * n / 2 for n in rec.prompt[:2]), 2)
    assert rec.arrival[:2] == [0.0, 0.0] and max(rec.first_s[:2]) <= 2 * alone + 0.05 < 5.0
    assert min(rec.finish_s) > 0 and len(rec.arrival) > 3  # every one answered; the streams went on


def test_traces_plain_and_mooncake(tmp_path):
    plain = tmp_path / "t.jsonl"
    plain.write_text("\n".join(json.dumps(r) for r in [
        {"arrival_s": 0.5, "prompt_tokens": 100, "output_tokens": 5, "prefix_id": "sys", "prefix_tokens": 64},
        {"arrival_s": 0.1, "prompt_tokens": 80, "output_tokens": 3, "prefix_id": "sys", "prefix_tokens": 64}]))
    reqs = read_trace(plain)
    assert [r.arrival_s for r in reqs] == [0.0, 0.4] and len(reqs[0].prefix_keys) == 4
    moon = tmp_path / "m.jsonl"
    moon.write_text("\n".join(json.dumps(r) for r in [
        {"timestamp": 1000, "input_length": 1100, "output_length": 20, "hash_ids": [1, 2, 3]},
        {"timestamp": 6000, "input_length": 600, "output_length": 10, "hash_ids": [1, 9]}]))
    reqs = read_trace(moon)
    assert reqs[0].prefix_keys == (1, 2) and reqs[1].prefix_keys == (1,) and reqs[1].arrival_s == 5.0
    s = simulate(PROFILE, ClusterConfig(), reqs)
    assert s["completed"] == 2 and s["cost"]["prefix_cache"]["hit_tokens"] == 512
    with pytest.raises(ValueError, match="m2.jsonl:1"):
        (tmp_path / "m2.jsonl").write_text('{"timestamp": 1}')
        read_trace(tmp_path / "m2.jsonl")


def test_profile_file_round_trip_and_validation(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(PROFILE.to_json()))
    assert load_profile(path) == PROFILE
    spec = replace(PROFILE, tokens_per_event=1.9, itl_shape=(0.7, 1.0, 1.3), spec_token_s=0.002)
    path.write_text(json.dumps(spec.to_json()))
    assert load_profile(path) == spec
    bad = PROFILE.to_json()
    bad["decode"]["fit"]["per_seq_s"] = -1
    with pytest.raises(ValueError, match="per_seq_s"):
        Profile.from_json(bad)
    with pytest.raises(ValueError, match="mode"):
        ClusterConfig(mode="sideways")
    with pytest.raises(ValueError):
        SimRequest(0.0, 0, 5)
    shipped = load_profile(None)  # the default profile measured on this machine loads
    assert shipped.decode.base_s > 0 and shipped.prefill.per_token_s > 0


def test_a_cpu_profile_from_another_kind_of_cpu_is_said_so(tmp_path, caplog):
    from shared.kernels.cpu_ext import cpu_isa

    here = cpu_isa()
    for isa, warned in ((here, False), ("amx" if here != "amx" else "avx2", True), ("", False)):
        path = tmp_path / f"p-{isa or 'unknown'}.json"
        path.write_text(json.dumps(replace(PROFILE, meta={"device": "cpu", "isa": isa}).to_json()))
        caplog.clear()
        load_profile(path)
        said = [r.getMessage() for r in caplog.records if "was measured on" in r.getMessage()]
        assert bool(said) == warned, (isa, here, said)
        if warned:
            assert f"runs {here} kernels" in said[0] and "pdserve profile" in said[0]


def test_the_shipped_profile_is_the_one_measured_on_this_kind_of_cpu(monkeypatch):
    import shared.kernels.cpu_ext as cpu_ext
    from shared.sim.cost import DEFAULT_PROFILE, shipped_profile

    cpu_profiles = sorted(DEFAULT_PROFILE.parent.glob(f"{DEFAULT_PROFILE.stem}*.json"))
    assert len(cpu_profiles) >= 2
    for path in cpu_profiles:  # each file is named by the ISA it was measured with
        isa = json.loads(path.read_text())["meta"]["isa"]
        monkeypatch.setattr(cpu_ext, "cpu_isa", lambda isa=isa: isa)
        assert shipped_profile() == path and load_profile(None).meta["isa"] == isa
    monkeypatch.setattr(cpu_ext, "cpu_isa", lambda: "torch")  # none of its own: the reference
    assert shipped_profile() == DEFAULT_PROFILE


def test_bench_lengths_are_the_bench_workloads():
    from services.bench.workloads import Workload

    wl = Workload("long-doc", 3)
    for i in range(5):
        assert bench_request(wl, i, 0.0).output_tokens == wl.request(i).max_tokens
        assert bench_request(wl, i, 0.0).prompt_tokens == wl.request(i).prompt_tokens + 11


def test_simulate_cli_json_to_stdout():
    proc = subprocess.run([sys.executable, "-m", "services.cli", "simulate", "--workload", "chat", "--duration", "30",
                           "--request-rate", "0.5", "--prefill", "1", "--decode", "2", "--slo-ttft-ms", "2000",
                           "--slo-tpot-ms", "300", "--json", "-"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    (run,) = data["runs"]
    s = run["summary"]
    assert s["completed"] == s["sent"] > 0 and s["goodput"]["slo_ttft_ms"] == 2000
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        d = s[key]
        assert d["min"] <= d["p50"] <= d["p90"] <= d["p99"] <= d["max"]
    assert s["cost"]["prefill"]["workers"] == 1 and s["cost"]["decode"]["workers"] == 2
    assert math.isfinite(s["sim"]["requests_per_wall_s"])


def test_simulate_cli_runs_the_prefill_pool_on_its_own_profile():
    profiles = Path(__file__).parents[2] / "shared/sim/profiles"
    args = [sys.executable, "-m", "services.cli", "simulate", "--workload", "long-doc", "--duration", "20",
            "--request-rate", "2", "--profile", str(profiles / "roofline-llama3-70b-tp8-h100.json"),
            "--prefill-profile", str(profiles / "roofline-llama3-70b-tp4-h100.json"), "--prefill", "3",
            "--decode", "1", "--prefill-max-inflight", "2", "--kv-path", "network"]
    proc = subprocess.run(args + ["--json", "-"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    (run,) = json.loads(proc.stdout)["runs"]
    s = run["summary"]
    assert s["completed"] == s["sent"] > 0 and s["per_gpu"]["gpus"] == pytest.approx(3 * 4 + 8)
    assert "prefill (on " in proc.stderr
    proc = subprocess.run(args + ["--mode", "colocated"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "no prefill profile of its own" in proc.stderr


class Scripted:
    """A scaler that follows a fixed schedule of (from time, prefill, decode)."""

    def __init__(self, schedule, interval_s=1.0, startup_s=0.5):
        self.schedule, self.interval_s, self.startup_s = schedule, interval_s, startup_s
        self.seen = []

    def targets(self, now, arrived, waiting, load=None):
        self.seen.append((now, arrived))
        return next((p, d) for t, p, d in reversed(self.schedule) if now >= t)


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_pools_change_size_and_a_removed_worker_drains_first(mode):
    reqs = _requests(n=120, rate=8.0)
    scaler = Scripted([(0.0, 1, 1), (2.0, 3, 3), (8.0, 1, 1)])
    cluster = Cluster(PROFILE, ClusterConfig(mode=mode, prefill=1, decode=1), scaler=scaler)
    cluster.run([replace(r) for r in reqs], check_every=1)
    cluster.check_invariants(final=True)  # includes: no worker left with work unfinished
    assert sum(cluster.rec.tokens) == sum(r.output_tokens for r in reqs)
    assert [n for _, n in scaler.seen] == sorted(n for _, n in scaler.seen)  # it sees arrivals so far
    grown = [w for w in cluster.retired + cluster.decode_pool if w.born_s == 2.0 and w.role != "prefill"]
    assert len(grown) == 2 and all(w.busy_s > 0 for w in grown)  # the added workers served
    retired = [w for w in cluster.retired if w.role != "prefill"]
    assert len(retired) == 2 and all(w.retired_s >= 8.0 for w in retired)
    s = cluster.report()
    role = "colocated" if mode == "colocated" else "decode"
    assert s["cost"][role]["max_workers"] == 3
    end = max(cluster.rec.finish_s)
    everyone = [w for w in cluster.retired + cluster.decode_pool if w.role != "prefill"]
    alive = sum((end if w.retired_s is None else w.retired_s) - w.born_s for w in everyone)
    assert s["cost"][role]["workers"] == pytest.approx(alive / end) and 1 < s["cost"][role]["workers"] < 3
    assert s["scaling"]["changes"] == 2
    # the same requests on a fixed fleet of 3: what the scaled fleet spends is less
    fixed = simulate(PROFILE, ClusterConfig(mode=mode, prefill=3, decode=3), [replace(r) for r in reqs])
    assert s["per_gpu"]["gpus"] < fixed["per_gpu"]["gpus"]


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_a_run_measured_from_a_time_counts_the_requests_and_the_workers_time_from_then_on(mode):
    """`measure_from_s`: what came before is a warm-up (the study's first day): the requests that
    arrived from then on, over the time from then on, and the GPUs held from then on."""
    reqs = _requests(n=120, rate=8.0)
    cluster = Cluster(PROFILE, ClusterConfig(mode=mode, prefill=1, decode=1),
                      scaler=Scripted([(0.0, 1, 1), (2.0, 3, 3), (8.0, 1, 1)]))
    cluster.run([replace(r) for r in reqs], check_every=1)
    since, end = 10.0, max(cluster.rec.finish_s)
    s = cluster.report(since_s=since)
    assert s["sent"] == sum(r.arrival_s >= since for r in reqs) < 120 and s["completed"] == s["sent"]
    assert s["duration_s"] == pytest.approx(end - since)
    role = "colocated" if mode == "colocated" else "decode"
    everyone = [w for w in cluster.retired + cluster.decode_pool if w.role != "prefill"]
    alive = sum(max(0.0, (end if w.retired_s is None else w.retired_s) - max(w.born_s, since)) for w in everyone)
    assert s["cost"][role]["workers"] == pytest.approx(alive / (end - since))
    assert s["cost"][role]["workers"] < cluster.report()["cost"][role]["workers"]  # the 3 workers mostly before
    fixed = simulate(PROFILE, ClusterConfig(mode=mode, prefill=3, decode=3), [replace(r) for r in reqs],
                     measure_from_s=since)
    per = PROFILE.limits.gpus_per_worker
    assert fixed["per_gpu"]["gpus"] == pytest.approx((3 if mode == "colocated" else 6) * per)  # held throughout
    assert fixed["sent"] == s["sent"]
    assert fixed["request_throughput"] == pytest.approx(s["sent"] / fixed["duration_s"])


def test_a_worker_removed_while_loading_never_serves():
    reqs = _requests(n=30, rate=5.0)
    scaler = Scripted([(0.0, 1, 1), (1.0, 1, 2), (2.0, 1, 1)], interval_s=1.0, startup_s=5.0)
    cluster = Cluster(PROFILE, ClusterConfig(), scaler=scaler)
    cluster.run([replace(r) for r in reqs], check_every=1)
    cluster.check_invariants(final=True)
    (gone,) = cluster.retired
    assert gone.born_s == 1.0 and gone.retired_s == 2.0 and gone.busy_s == 0
    assert cluster.report()["cost"]["decode"]["max_workers"] == 2


def test_simulate_cli_resizes_with_the_forecast_planner():
    proc = subprocess.run([sys.executable, "-m", "services.cli", "simulate", "--workload", "chat", "--duration", "120",
                           "--request-rate", "2", "--prefill", "1", "--decode", "1", "--scale-capacity", "0.5,0.5",
                           "--scale-interval", "10", "--startup-s", "10", "--max-workers", "6",
                           "--slo-ttft-ms", "4000", "--slo-tpot-ms", "200", "--json", "-"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    s = json.loads(proc.stdout)["runs"][0]["summary"]
    assert s["completed"] == s["sent"] > 0
    assert s["scaling"]["changes"] >= 1 and "resized" in proc.stderr
    # the SLOs per 5 minutes of arrivals: two minutes of them are one window
    assert [w[:2] for w in s["scaling"]["slo_by_window"]] == [[0.0, s["sent"]]]
    assert s["scaling"]["slo_by_window"][0][4] == pytest.approx(s["goodput"]["attainment_pct"], abs=1e-3)
    assert "of each 5 minutes' arrivals" in proc.stderr
    assert max(p + d for _, p, d in s["scaling"]["log"]) <= 6  # 2 req/s ÷ 0.5 wants 4 + 4: the budget binds
    assert s["cost"]["prefill"]["max_workers"] > 1 and 1 < s["per_gpu"]["workers"] <= 6
    short = subprocess.run([sys.executable, "-m", "services.cli", "simulate", "--workload", "chat", "--duration", "20",
                            "--scale-capacity", "0.5,0.5", "--scale-interval", "10", "--startup-s", "10",
                            "--season-s", "30"], capture_output=True, text=True, timeout=120)
    assert short.returncode != 0 and "a season must span a startup and three intervals" in short.stderr, short.stderr


def test_pools_on_one_hosts_cores_lend_them_while_idle():
    """Profile.unlent: a prefill step while a decode worker holds sequences takes ×2 here, a decode
    step of ≥ 2 sequences while a prefill step runs ×1.5; a lone decode stream never borrowed (one
    colocated engine has both cores: it does). Spans stay exact with it."""
    shared = replace(PROFILE, unlent=(2.0, 1.5))
    decode_only = replace(PROFILE, unlent=(2.0, 1.0))
    long_prompt = SimRequest(1.0, 200, 2)

    def run(profile, reqs, **cfg):
        cluster = Cluster(profile, ClusterConfig(**cfg))
        cluster.run([replace(r) for r in reqs], check_every=1)
        cluster.check_invariants(final=True)
        return cluster.rec

    def ttft(rec, i):
        return rec.first_s[i] - rec.arrival[i]

    alone = run(shared, [long_prompt])  # nothing decodes: the prefill borrows
    assert ttft(alone, 0) == pytest.approx(ttft(run(PROFILE, [long_prompt]), 0))
    one_stream = [SimRequest(0.0, 16, 400), long_prompt]
    beside = run(shared, one_stream)
    assert ttft(beside, 1) == pytest.approx(2 * ttft(alone, 0))
    # a batch of one decodes at its own speed through the prefill
    assert beside.finish_s[0] == pytest.approx(run(decode_only, one_stream).finish_s[0])
    two_streams = [SimRequest(0.0, 16, 400), SimRequest(0.0, 16, 400), long_prompt]
    slowed, unslowed = run(shared, two_streams), run(decode_only, two_streams)
    step = PROFILE.decode_time(2, 2 * 200)
    delay = slowed.finish_s[0] - unslowed.finish_s[0]  # the steps it lost while the prompt prefilled
    lost = ttft(slowed, 2) * (1 - 1 / 1.5)
    assert lost - 2 * step < delay < lost + 2 * step
    reqs = _requests(n=40, rate=3.0)
    for mode in ("disaggregated", "conditional"):  # spans cut where the cores change: exact
        fast = run(shared, reqs, mode=mode, decode=2)
        exact = run(shared, reqs, mode=mode, decode=2, decode_spans=False)
        assert fast.finish_s == pytest.approx(exact.finish_s, rel=1e-9, abs=1e-9), mode
        assert fast.finish_s != pytest.approx(run(PROFILE, reqs, mode=mode, decode=2).finish_s), mode
    # one colocated engine has the host to itself: its steps run as fitted, but for a lone stream's,
    # which gets both cores where the calibration's decode worker had its one
    stream = [SimRequest(0.0, 16, 400)]
    own, fitted = run(shared, stream, mode="colocated"), run(PROFILE, stream, mode="colocated")
    assert own.finish_s[0] - own.first_s[0] == pytest.approx((fitted.finish_s[0] - fitted.first_s[0]) / 1.5)


def test_engines_share_a_cpu_hosts_cores_as_pdserve_up_gives_them():
    """shared/sim/cores.py: on 2 cores two colocated engines (a core each) lend each other theirs
    while one is idle and prefill on their own while both hold sequences; three prefill workers and
    a decode worker (a core each, on 2): three prompts at once divide the host, and with a stream
    decoding beside them the four engines get half a core each."""
    shared = replace(PROFILE, unlent=(2.0, 1.0), meta={"device": "cpu", "machine": "x86_64 2 cores"})
    prompt, stream = SimRequest(0.0, 480, 2), SimRequest(0.0, 16, 3000)

    def ttfts(reqs, **cfg):
        cluster = Cluster(shared, ClusterConfig(**cfg))
        cluster.run([replace(r) for r in reqs], check_every=1)
        cluster.check_invariants(final=True)
        return [f - a for f, a in zip(cluster.rec.first_s, cluster.rec.arrival)]

    alone = ttfts([prompt], mode="colocated")[0]
    assert alone == pytest.approx(ttfts([prompt], mode="colocated", decode=2)[0])  # it borrows the idle one's
    assert ttfts([prompt, prompt], mode="colocated", decode=2) == pytest.approx([2 * alone] * 2)
    assert ttfts([prompt], prefill=3)[0] == pytest.approx(alone)
    assert ttfts([prompt] * 3, prefill=3) == pytest.approx([3 * alone] * 3)  # 2/3 of a core each
    # a probe of the work itself (`pdserve plan`'s roomy pools): every engine on cores of its own
    assert ttfts([prompt] * 3, prefill=3, shared_cores=False) == pytest.approx([alone] * 3)
    beside = ttfts([stream] + [replace(prompt, arrival_s=0.5)] * 3, prefill=3)
    assert beside[1:] == pytest.approx([4 * alone] * 3, rel=0.01)  # half a core each, ×2 from one core


def test_a_prefill_step_begun_on_borrowed_cores_slows_while_a_decode_worker_holds_sequences():
    """A real worker takes its threads as a step begins: a prefill step begun while nothing decodes
    borrows the decode worker's core, and shares it once the decode worker holds a sequence (×2 here
    from then), until it holds nothing again."""
    shared = replace(PROFILE, unlent=(2.0, 1.0))
    prompt = SimRequest(0.0, 480, 2)

    def run(reqs):
        cluster = Cluster(shared, ClusterConfig(mode="conditional"))  # a short prompt goes to the decode worker
        cluster.run([replace(r) for r in reqs], check_every=1)
        cluster.check_invariants(final=True)
        return cluster.rec

    alone = run([prompt]).first_s[0]
    long_stream, short_stream = run([prompt, SimRequest(0.0, 16, 2000)]), run([prompt, SimRequest(0.0, 16, 3)])
    assert long_stream.first_s[1] < alone  # the stream decodes while the prompt is prefilled
    assert long_stream.first_s[0] == pytest.approx(2 * alone)  # held from its start: half speed throughout
    assert short_stream.finish_s[1] < alone
    # … and while that one is held, the step does half the work it would have: it ends that much later
    assert short_stream.first_s[0] == pytest.approx(alone + short_stream.finish_s[1] / 2)


def test_the_kv_handoff_delays_the_first_decode_step():
    req = [SimRequest(0.0, 100, 5)]
    base = Cluster(PROFILE, ClusterConfig())
    base.run(list(req))
    later = Cluster(replace(PROFILE, handoff_s=0.05), ClusterConfig())
    later.run(list(req))
    assert later.rec.first_s == base.rec.first_s
    assert later.rec.finish_s[0] == pytest.approx(base.rec.finish_s[0] + 0.05)


def test_a_prefill_pool_on_a_profile_of_its_own():
    """The prefill pool on another tensor-parallel group: its steps and KV writes are timed by its own
    profile, its GPUs counted at its own size; the decode pool keeps the main profile's."""
    slow = replace(PROFILE, prefill=replace(PROFILE.prefill, per_token_s=2e-3),
                   transfer={"shm": TransferFit(LinearFit(0.03, 1e-10), LinearFit(1e-3, 1e-10))},
                   limits=replace(PROFILE.limits, gpus_per_worker=2))
    req = [SimRequest(0.0, 200, 5)]
    base = Cluster(PROFILE, ClusterConfig())
    base.run(list(req))
    split = Cluster(PROFILE, ClusterConfig(), prefill_profile=slow)
    split.run(list(req))
    split.check_invariants(final=True)
    ttft = base.rec.first_s[0]
    assert split.rec.first_s[0] == pytest.approx(ttft + 200 * 1e-3)  # the one prefill step: 200 tokens, 1 ms more each
    # the decode worker waits for the slower write (30 ms more), then decodes as before
    assert split.rec.finish_s[0] - split.rec.first_s[0] == pytest.approx(base.rec.finish_s[0] - ttft + 0.029)
    report = split.report()
    assert report["cost"]["prefill"]["gpu_s"] == pytest.approx(2 * report["cost"]["decode"]["gpu_s"])
    assert report["per_gpu"]["gpus"] == pytest.approx(3) and base.report()["per_gpu"]["gpus"] == pytest.approx(2)
    reqs = _requests()
    s = simulate(PROFILE, ClusterConfig(prefill=2, decode=2), reqs, prefill_profile=slow, check=True)
    assert s["completed"] == len(reqs) and s["per_gpu"]["gpus"] == pytest.approx(6)
    with pytest.raises(ValueError, match="not the same model"):
        Cluster(PROFILE, ClusterConfig(), prefill_profile=replace(slow, limits=replace(slow.limits, block_size=32)))
    with pytest.raises(ValueError, match="colocated"):
        Cluster(PROFILE, ClusterConfig(mode="colocated"), prefill_profile=slow)


def test_a_decode_row_riding_on_a_prompts_chunk_is_one_token_one_event():
    """A colocated engine computes a long prompt's chunks with a stream's decode row in the same
    forward pass (prefill rates, the row's KV read as a decode step's). With speculative decoding
    (τ 2) a decode step's token is half an event; a chunk that fills the budget leaves no room for
    drafts, so the stream's token from it is a whole event, its gap the whole step (not 2×)."""
    spec = replace(PROFILE, tokens_per_event=2.0, drafts_per_event=1.0)
    cluster = Cluster(spec, ClusterConfig(mode="colocated"))
    cluster.run([SimRequest(0.0, 16, 400), SimRequest(0.5, 2000, 2)], check_every=1)
    cluster.check_invariants(final=True)
    rec = cluster.rec
    assert rec.first_s[1] - 0.5 > 5 * spec.prefill_time(255, 255 * 128, 1)  # 8 chunks of the budget
    ctx = 16 + 400  # at most the stream's whole context
    chunk = spec.prefill_time(255, 255 * (1744 + 128), 1) + spec.riding_decode_time(1, ctx)  # the last full one
    gaps = rec.hists[rec.kind[0]]
    assert chunk * 0.8 < gaps.hi < chunk * 1.05
    assert spec.riding_decode_time(1, ctx) < spec.decode_time(1, ctx) * spec.tokens_per_event  # a row, not a step


def test_a_bench_result_is_a_trace_of_its_requests_at_their_acceptance(tmp_path):
    """`pdserve simulate --trace bench.json`: a real run's answered requests (when each was sent, its
    prompt, the tokens it got) replayed, at the tokens and drafts per event they got."""
    from shared.sim.workload import bench_acceptance

    def record(sent, prompt, out, events, drafts, status="ok"):
        return {"sent_s": sent, "prompt_tokens": prompt, "output_tokens": out, "kind": "chat", "status": status,
                "token_times_s": [sent + 0.1 * i for i in range(events + 1)], "draft_tokens": drafts}

    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"runs": [{"summary": {}, "records": [
        record(5.0, 120, 31, 10, 20), record(2.0, 300, 21, 10, 16), record(3.0, 50, 0, 0, 0, status="error")]}]}))
    reqs = read_trace(path)
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in reqs] == [(0.0, 300, 21), (3.0, 120, 31)]
    tau, drafts = bench_acceptance(path)
    assert tau == pytest.approx((30 + 20) / 20) and drafts == pytest.approx(36 / 20)
    # what `pdserve simulate` and `pdserve plan` time the decode steps at: the flags', else the result's
    import argparse

    from services.planner.plan import add_plan_args
    from services.planner.simulate import workload_profile

    plan = argparse.ArgumentParser()
    add_plan_args(plan)
    args = plan.parse_args(["--trace", str(path), "--slo-ttft-p90-ms", "1", "--slo-itl-p90-ms", "1"])
    assert workload_profile(args, PROFILE).tokens_per_event == pytest.approx(tau)
    args.tokens_per_event = 3.0
    assert workload_profile(args, PROFILE).tokens_per_event == 3.0
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"arrival_s": 0, "prompt_tokens": 10, "output_tokens": 2}\n')
    assert bench_acceptance(trace) is None and len(read_trace(trace)) == 1
    trace.write_text('{"arrival_s": 0, "prompt_tokens": 10, "output_tokens": 2}\n\n{"arrival_s": 1, "prompt_')
    with pytest.raises(ValueError, match=r"t\.jsonl:3: "):  # a malformed line is named, blank ones counted
        read_trace(trace)


def test_the_shares_of_a_hosts_cores_follow_the_workers_present():
    """`pdserve up`'s fair share: on 4 cores, 1 + 3 engines have a core each; once two decode
    workers are drained the two left have two each, so a prompt beside a decoding stream prefills as
    fast as on a 1 + 1 deployment (it would keep one core, and take ×2, on the shares it started with)."""
    four = replace(PROFILE, unlent=(2.0, 1.0), meta={"device": "cpu", "machine": "x86_64 4 cores"})
    reqs = [SimRequest(10.0, 16, 400), SimRequest(10.5, 480, 2)]

    def run(cfg, scaler=None):
        cluster = Cluster(four, cfg, scaler=scaler)
        cluster.run([replace(r) for r in reqs], check_every=1)
        cluster.check_invariants(final=True)
        return cluster

    drained = run(ClusterConfig(prefill=1, decode=3), Scripted([(0.0, 1, 3), (1.0, 1, 1)]))
    static = run(ClusterConfig(prefill=1, decode=1))
    assert len(drained.retired) == 2 and drained.host.share == static.host.share == 2
    assert drained.rec.first_s[1] == pytest.approx(static.rec.first_s[1])
    assert run(ClusterConfig(prefill=1, decode=3)).host.share == 1


def test_a_decode_step_costs_what_its_width_does():
    """`Profile.decode_wide` (a calibration's fit of the engine's steps on the whole host): a lone
    stream steps on its share — a decode worker's batch of one never borrows — and on the whole host
    in one colocated engine (its share is the host), slower there (the fixed part of a step grows
    with its threads); two streams borrow the idle prefill worker's core and step at the whole
    host's cost, and at the share's while a long prompt prefills beside them."""
    share, wide = DecodeFit(0.010, 5e-3, 0.0), DecodeFit(0.016, 0.5e-3, 0.0)
    cpu = replace(PROFILE, decode=share, decode_wide=wide, unlent=(2.0, 1.0),
                  meta={"device": "cpu", "machine": "x86_64 2 cores"})
    stream = SimRequest(0.0, 16, 201)

    def decode_s(reqs, **cfg):
        cluster = Cluster(cpu, ClusterConfig(**cfg))
        cluster.run([replace(r) for r in reqs], check_every=1)
        cluster.check_invariants(final=True)
        return [f - s for f, s in zip(cluster.rec.finish_s, cluster.rec.first_s)]

    assert decode_s([stream])[0] == pytest.approx(200 * 0.015, abs=0.005)  # 1 + 1: on its own core (+ the KV read)
    assert decode_s([stream], mode="colocated")[0] == pytest.approx(200 * 0.0165)  # the whole host
    two = decode_s([stream, stream])
    assert two == pytest.approx([200 * 0.017] * 2, rel=0.02)  # both cores: 16 + 2 × 0.5 ms, not 10 + 2 × 5
    beside = decode_s([stream, stream, SimRequest(0.5, 2000, 2)])  # from 0.5 s on a core: 20 ms steps
    assert 1.1 * two[0] < beside[0] < 1.01 * 200 * 0.020
    assert replace(cpu, decode_wide=None).wide_decode_ratio(8, 100) == 1.0
    assert Profile.from_json(cpu.to_json()).decode_wide == wide
    moved = cpu.with_tokens_per_event(2.0, 1.0)
    assert moved.decode_time(1, 0, wide=True) == pytest.approx(0.0165 / 2)  # τ 2 (no cost given for drafts)


@pytest.mark.parametrize("decode", [1, 2])
def test_a_decode_job_too_big_beside_a_running_request_is_handed_back_then_waits(decode):
    """As the real decode worker (services/decode/worker.py): a long answer fills most of a 48-block
    worker; documents of 41 blocks come while it runs. The busy worker hands each back once; with a
    second worker the documents go there and none waits, alone the busy worker takes one back and
    it waits there until the answer's blocks are freed (not a redelivery a second later)."""
    answer = SimRequest(0.0, 20, 640)
    docs = [SimRequest(t, 650, 5, kind="long") for t in (3.0, 6.0, 9.0)]
    cluster = _run(ClusterConfig(prefill=1, decode=decode, num_kv_blocks=48), [answer, *docs])
    stats, rec = cluster.kv_stats, cluster.rec
    assert max(w.max_used_blocks for w in cluster.decode_pool) <= 48
    assert stats["handed_back"] >= 1
    if decode == 2:
        assert stats["waited"] == 0
        assert all(rec.finish_s[rid] < rec.finish_s[0] for rid in (1, 2, 3))  # none behind the answer
    else:
        assert stats["waited"] >= 1
        waited = [rid for rid in (1, 2, 3) if rec.finish_s[rid] > rec.finish_s[0]]
        assert waited, "no document waited for the answer's blocks"
        # it joins at the answer's last step: its 4 decode steps follow (one job pulled at a time)
        first_after = min(rec.finish_s[rid] for rid in waited)
        assert first_after - rec.finish_s[0] < 4 * 0.05 + 0.05


def test_a_decode_job_waiting_for_room_goes_to_a_worker_that_frees_room_first():
    """Two 48-block decode workers, one decoding a long answer, the other a shorter one; a document
    of 41 blocks fits beside neither. Both hand it back; it comes back to the first and waits there,
    unread. When the shorter answer ends, the other worker has room: the job is handed on once more
    and decoded there, long before the long answer ends (it waited for that end before)."""
    reqs = [SimRequest(0.0, 20, 640), SimRequest(0.5, 20, 200), SimRequest(3.0, 650, 5, kind="long")]
    cluster = _run(ClusterConfig(prefill=1, decode=2, num_kv_blocks=48), reqs)
    stats, finish = cluster.kv_stats, cluster.rec.finish_s
    assert stats["waited"] == 1 and stats["handed_back"] == 3, stats
    assert finish[1] < finish[2] < finish[1] + 0.5  # decoded just after the shorter answer ended …
    assert finish[2] < finish[0] - 5  # … not after the long one



def test_a_decode_job_waiting_on_a_worker_that_drains_goes_back_to_the_queue_at_once():
    """As the real decode worker stopped while a job waits on it unread: the job goes back to the
    front of the decode queue when the worker is told to drain, and the worker leaves when its own
    requests end. Two 48-block workers: A decodes a long answer and a shorter one, B a shorter one;
    a 41-block document fits beside neither and waits on B. B is drained: the document goes back,
    to A, and waits there for room (no other worker has any); B leaves as its answer ends. (It kept
    the document, read it then and decoded it before leaving: a drain that takes new work.)"""
    reqs = [SimRequest(0.0, 20, 640), SimRequest(0.05, 20, 300), SimRequest(0.1, 20, 300),
            SimRequest(3.0, 650, 5, kind="long")]
    scaler = Scripted([(0.0, 1, 2), (4.0, 1, 1)], interval_s=0.5)
    cluster = Cluster(PROFILE, ClusterConfig(prefill=1, decode=2, num_kv_blocks=48), scaler=scaler)
    cluster.run(reqs, check_every=1)
    cluster.check_invariants(final=True)
    stats, finish = cluster.kv_stats, cluster.rec.finish_s
    (b,) = [w for w in cluster.retired if w.role == "decode"]
    (a,) = cluster.decode_pool
    assert stats["waited"] == 2, stats  # on B, then on A
    assert b.retired_s == pytest.approx(finish[1], abs=0.01)  # B left as its answer ended …
    assert finish[3] > finish[0]  # … and the document waited on A for the long answer's blocks
