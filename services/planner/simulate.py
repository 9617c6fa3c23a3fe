"""`pdserve simulate`: run the discrete-event simulator (shared/sim) on a workload or a trace and
report what `pdserve bench` would (same JSON shape: runs[].summary), plus cost per phase.

    pdserve simulate --workload chat --prefill 1 --decode 1 --duration 60 --request-rate 0.5 --json -
    pdserve simulate --trace mooncake.jsonl --prefill 300 --decode 700 --profile gpu.json --json out.json
    pdserve simulate --workload interference --max-concurrency 4 --duration 30 --long-interval 5
    pdserve simulate --trace day.jsonl --prefill 90 --decode 35 --scale --slo-ttft-ms 4000 --slo-tpot-ms 40
    pdserve simulate --trace bench.json --mode colocated --decode 2     (a real run's requests, simulated again)

With `--scale`, the pools change size while it runs: the forecast planner of `pdserve planner
--policy forecast` (services/planner/forecast.py) decides every `--scale-interval`, starting from
--prefill / --decode, each pool sized from the profile and the mix of the requests finished so far
(`--scale-capacity` gives a fixed req/s per worker instead); cost is the GPU time each worker was held.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from services.bench.workloads import WORKLOADS, Workload, parse_range
from services.planner.forecast import Capacity, ForecastScaler, ProfileSizer, headroom_arg
from shared.sim.cluster import MODES, SLO_WINDOW_S, ClosedLoop, ClusterConfig, simulate
from shared.sim.cost import Profile, load_profile
from shared.sim.workload import bench_acceptance, bench_request, poisson_requests, read_trace

RUN_INDEX_STRIDE = 1_000_000  # as services/bench/runner.py: each run its own request indices


def _range(text: str) -> tuple[int, int]:
    try:
        return parse_range(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_acceptance_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens-per-event", type=float, default=None,
                   help="the workload's tokens per streamed event with speculative decoding (its acceptance; "
                        "default: a --trace bench result's, else the profile's calibration)")
    p.add_argument("--drafts-per-event", type=float, default=None,
                   help="the draft tokens a sequence's step verifies, per event (pdserve's usage.draft_tokens over "
                        "the events; default: the profile's, moved as --tokens-per-event moves)")


def workload_profile(args: argparse.Namespace, profile: Profile) -> Profile:
    """`profile` at the workload's acceptance: the flags', else a `--trace` bench result's requests'."""
    tau, drafts = args.tokens_per_event, args.drafts_per_event
    if tau is None and drafts is None and getattr(args, "trace", None):
        tau, drafts = bench_acceptance(args.trace) or (None, None)
    if tau is None and drafts is None:
        return profile
    return profile.with_tokens_per_event(tau or profile.tokens_per_event, drafts)


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", default=None, help="profile JSON (default: the one shipped for this machine)")
    add_acceptance_args(p)
    p.add_argument("--mode", default="disaggregated", choices=MODES)
    p.add_argument("--prefill", type=int, default=1, help="prefill workers")
    p.add_argument("--decode", type=int, default=1, help="decode workers (colocated: engine workers)")
    p.add_argument("--kv-path", default="shm", choices=["shm", "network"])
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="chunk budget (default: the profile's)")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--num-kv-blocks", type=int, default=None, help="per decode worker")
    p.add_argument("--prefill-profile", default=None, metavar="FILE",
                   help="the prefill pool's own profile: the same model on another tensor-parallel group "
                        "(default: --profile)")
    p.add_argument("--prefill-max-inflight", type=int, default=None,
                   help="jobs a prefill worker takes at once (default: the profile's)")
    g = p.add_argument_group("a fleet resized while it runs (the forecast planner)")
    g.add_argument("--scale", action="store_true",
                   help="resize the pools while it runs: each sized for the forecast load from the profile and the "
                        "finished requests' mix, within --slo-ttft-ms and --slo-tpot-ms")
    g.add_argument("--scale-capacity", default=None, metavar="PREFILL_RPS,DECODE_RPS",
                   help="resize them by req/s one worker of each pool carries within the SLOs instead (pdserve plan "
                        "prints it for the load it searched); implies --scale")
    g.add_argument("--scale-attainment", type=float, default=95.0,
                   help="--scale: the percentage of requests the profile sizer keeps within each SLO")
    g.add_argument("--scale-interval", type=float, default=60.0, help="seconds between decisions")
    g.add_argument("--startup-s", type=float, default=120.0, help="seconds from adding a worker until it serves")
    g.add_argument("--headroom", type=headroom_arg, default=0.1, metavar="H | PREFILL,DECODE",
                   help="capacity above the forecast, for both pools or each its own")
    g.add_argument("--season-s", type=float, default=None, metavar="SECONDS",
                   help="the load's period: once a whole one is seen, the forecast is what the load did a period ago "
                        "at today's level, where that shape explains the latest intervals")
    g.add_argument("--max-workers", type=int, default=10_000, help="prefill + decode workers at most")


def add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", default="chat", choices=WORKLOADS)
    p.add_argument("--trace", default=None,
                   help="JSONL trace (plain or Mooncake-style), or a `pdserve bench --out` result (its requests "
                        "replayed, at their acceptance unless --tokens-per-event); overrides --workload")
    p.add_argument("--time-scale", type=float, default=1.0, help="trace: multiply arrival times (<1 = more load)")
    p.add_argument("--duration", type=float, default=None, help="send for this many (virtual) seconds")
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--request-rate", type=float, default=1.0, help="Poisson req/s (bench workloads)")
    p.add_argument("--max-concurrency", type=int, default=4, help="interference: chat streams")
    p.add_argument("--long-interval", type=float, default=5.0)
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--input-len", type=_range, default=None)
    p.add_argument("--output-len", type=_range, default=None)
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)


def add_simulate_args(p: argparse.ArgumentParser) -> None:
    add_cluster_args(p)
    add_workload_args(p)
    p.add_argument("--json", default=None, help="write the JSON report here ('-': stdout)")


def cluster_config(args: argparse.Namespace) -> ClusterConfig:
    return ClusterConfig(mode=args.mode, prefill=args.prefill, decode=args.decode, kv_path=args.kv_path,
                         max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                         num_kv_blocks=args.num_kv_blocks, prefill_max_inflight=args.prefill_max_inflight)


def make_scaler(args: argparse.Namespace, config: ClusterConfig, profile: Profile) -> ForecastScaler | None:
    """A fresh forecast planner for one run (it keeps state), or None without --scale / --scale-capacity."""
    if not (getattr(args, "scale", False) or getattr(args, "scale_capacity", None)):
        return None
    if args.scale_capacity:
        sizer = Capacity.parse(args.scale_capacity)
    elif args.slo_ttft_ms is None or args.slo_tpot_ms is None:
        raise ValueError("--scale sizes the pools for the SLOs: give --slo-ttft-ms and --slo-tpot-ms "
                         "(or --scale-capacity)")
    else:
        sizer = ProfileSizer(profile, args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3, args.scale_attainment / 100,
                             kv_path=config.kv_path)
    start = [config.prefill if config.mode != "colocated" else 1, config.decode]
    return ForecastScaler(sizer, interval_s=args.scale_interval, startup_s=args.startup_s,
                          headroom=args.headroom, current=start, budget=args.max_workers,
                          max_workers=(args.max_workers, args.max_workers), season_s=args.season_s)


def request_list(args: argparse.Namespace) -> list:
    """The open-loop requests of a trace or a bench workload at Poisson --request-rate."""
    if args.trace:
        reqs = read_trace(args.trace, time_scale=args.time_scale, limit=args.num_requests)
        return [r for r in reqs if args.duration is None or r.arrival_s < args.duration]
    if args.workload == "interference":
        raise ValueError("plan: the interference workload is closed-loop; give a trace or an open-loop workload")
    if args.duration is None and args.num_requests is None:
        raise ValueError("give --duration or --num-requests")
    return list(poisson_requests(args.workload, args.request_rate, args.seed, duration_s=args.duration,
                                 num_requests=args.num_requests, prompt_tokens=args.input_len,
                                 output_tokens=args.output_len))


def run_simulation(args: argparse.Namespace, profile: Profile, config: ClusterConfig,
                   prefill_profile: Profile | None = None) -> list[dict[str, Any]]:
    """One run per phase (interference: baseline and with long prompts), like `pdserve bench`."""
    slo = dict(slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms, prefill_profile=prefill_profile)
    if args.trace:
        return [_run("trace", math.nan, None, simulate(profile, config, request_list(args), **slo,
                                                        scaler=make_scaler(args, config, profile)))]
    if args.workload == "interference":
        if args.duration is None:
            raise ValueError("the interference workload needs --duration (and --max-concurrency chat streams)")
        chat = Workload("chat", args.seed, prompt_tokens=args.input_len, output_tokens=args.output_len)
        long = Workload("long-doc", args.seed)
        runs = []
        for k, phase in enumerate(("baseline", "with long prompts")):
            arrivals = []
            if k:
                at, j = args.warmup, 0
                while at < args.duration:
                    arrivals.append(bench_request(long, j, at))
                    at, j = at + args.long_interval, j + 1
            closed = ClosedLoop(lambda i, first=k * RUN_INDEX_STRIDE: bench_request(chat, first + i, 0.0),
                                args.max_concurrency, args.duration)
            summary = simulate(profile, config, arrivals, closed=closed, itl_from_s=args.warmup, **slo,
                               scaler=make_scaler(args, config, profile))
            runs.append(_run(phase, math.inf, args.max_concurrency, summary))
        return runs
    reqs = request_list(args)
    label = f"rate {args.request_rate:g} req/s"
    return [_run(label, args.request_rate, None, simulate(profile, config, reqs, **slo,
                                                          scaler=make_scaler(args, config, profile)))]


def _run(label: str, rate: float, cap: int | None, summary: dict[str, Any]) -> dict[str, Any]:
    return {"label": label, "request_rate": rate if math.isfinite(rate) else ("inf" if rate > 0 else None),
            "max_concurrency": cap, "duration_s": summary["duration_s"], "summary": summary}


def interference_ratio(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    phases = {r["label"]: r["summary"].get("by_kind", {}).get("chat", r["summary"]) for r in runs}
    base, long = phases.get("baseline"), phases.get("with long prompts")
    if not base or not long or not base.get("itl_ms") or not long.get("itl_ms"):
        return None
    b, w = base["itl_ms"]["p99"], long["itl_ms"]["p99"]
    return {"chat_itl_p99_ms_baseline": b, "chat_itl_p99_ms_with_long": w, "ratio": w / b if b > 0 else None}


def cmd_simulate(args: argparse.Namespace) -> int:
    from services.bench.report import _title, format_summary

    profile = workload_profile(args, load_profile(args.profile))
    config = cluster_config(args)
    prefill_profile = load_profile(args.prefill_profile) if args.prefill_profile else None
    runs = run_simulation(args, profile, config, prefill_profile)
    report = {"model": profile.meta.get("model", "?"), "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "simulated": True, "profile": str(args.profile or "default"), "profile_meta": profile.meta,
              "tokens_per_event": profile.tokens_per_event, "drafts_per_event": profile.drafts_per_event,
              "config": {k: v for k, v in vars(args).items() if k not in ("func",)} | {"cluster": config.__dict__},
              "interference": interference_ratio(runs), "runs": runs}
    text = json.dumps(report, indent=1, default=str)
    on = f" (on {args.prefill_profile})" if prefill_profile else ""
    lines = [f"pdserve simulate: {config.mode}, {config.prefill if config.mode != 'colocated' else 0} prefill{on} + "
             f"{config.decode} decode workers, {args.trace or args.workload}, profile {args.profile or 'default'}"]
    for run in runs:
        s = run["summary"]
        lines += [_title(f"Simulated: {run['label']}", "="), *format_summary(s),
                  f"simulated {s['sent']} requests in {s['sim']['wall_s']:.2f} s wall "
                  f"({s['sim']['requests_per_wall_s']:.0f} req/s, {s['sim']['events']} events)"]
        if "scaling" in s:
            pools = ", ".join(f"{k} {c['workers']:.1f} on average (at most {c['max_workers']})"
                              for k, c in s["cost"].items() if "max_workers" in c)
            lines.append(f"resized {s['scaling']['changes']} times: {pools}")
            windows = s["scaling"].get("slo_by_window")
            if windows:  # where in the run the SLOs were missed (as the load turns, say)
                worst = min(windows, key=lambda w: w[4])
                lines.append(f"both SLOs met by {min(w[4] for w in windows):.1f}-{max(w[4] for w in windows):.1f}% "
                             f"of each {SLO_WINDOW_S / 60:g} minutes' arrivals; the least from {worst[0]:.0f} s")
    if args.json == "-":
        print(text)
        print("\n".join(lines), file=sys.stderr)
    else:
        print("\n".join(lines))
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(text + "\n")
    return 0
