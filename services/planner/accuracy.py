"""Simulator vs reality on this machine: the same seeded workloads through a real `pdserve up` +
`pdserve bench`, and through the simulator on a profile measured and calibrated minutes before.

    python -m services.planner.accuracy --out accuracy.json     (≈ 3 min on 2 cores)

Cases (small and bounded, so the whole comparison fits a CI test): chat and long-doc at two Poisson
rates, the interference mix at two chat concurrencies. Compared per case: TTFT p50/p90, ITL p50/p90
(the interference mix: the chat streams' ones, with long prompts arriving) and request throughput.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("pdserve.accuracy")

# the five; TPOT (each request's mean gap) beside them: it is robust to the client reading two
# SSE events at once (a near-zero ITL) on a loaded machine, which ITL percentiles are not
METRICS = (("ttft_ms", "p50"), ("ttft_ms", "p90"), ("itl_ms", "p50"), ("itl_ms", "p90"), ("request_throughput", None),
           ("tpot_ms", "p50"))
ASSERTED = {"ttft_p50", "ttft_p90", "itl_p50", "itl_p90", "request_throughput"}
INPUTS = {"case", "tokens_per_event"}  # a row's keys that are not compared metrics


@dataclass(frozen=True)
class Case:
    name: str
    workload: str
    rate: float = math.inf
    num_requests: int | None = None
    concurrency: int | None = None  # interference: chat streams
    input_len: tuple[int, int] | None = None
    output_len: tuple[int, int] | None = None
    duration_s: float | None = None


CASES = (
    Case("chat low", "chat", rate=0.5, num_requests=10, output_len=(24, 48)),
    Case("chat high", "chat", rate=2.0, num_requests=14, output_len=(24, 48)),
    Case("long-doc low", "long-doc", rate=0.2, num_requests=5, input_len=(600, 1200), output_len=(16, 32)),
    Case("long-doc high", "long-doc", rate=0.6, num_requests=8, input_len=(600, 1200), output_len=(16, 32)),
    Case("interference low", "interference", concurrency=2, output_len=(24, 48), duration_s=12.0),
    Case("interference high", "interference", concurrency=4, output_len=(24, 48), duration_s=12.0),
)
LONG_LEN, LONG_OUT, WARMUP_S, LONG_INTERVAL_S = (600, 1200), (16, 32), 3.0, 4.0


def _real(url: str, gguf: str, case: Case, seed: int) -> tuple[dict[str, Any], float]:
    """The case's summary, and the tokens per event its streams got (its speculative acceptance:
    a property of the workload and of what the proposer has seen, which the simulator is told)."""
    from services.bench.runner import BenchConfig, run_benchmark
    from services.planner.calibrate import tokens_per_event

    common = dict(workload=case.workload, prompt_tokens=case.input_len, output_tokens=case.output_len,
                  tokenizer=gguf, progress=False, seed=seed)
    if case.workload == "interference":
        cfg = BenchConfig(url, max_concurrency=case.concurrency, duration_s=case.duration_s, warmup_s=WARMUP_S,
                          long_interval_s=LONG_INTERVAL_S, long_prompt_tokens=LONG_LEN, long_output_tokens=LONG_OUT,
                          interference_phases=("long",), **common)
        run = run_benchmark(cfg).runs[0]
        return (run.summary["by_kind"]["chat"] | {"request_throughput": run.summary["request_throughput"]},
                tokens_per_event([r for r in run.records if r.kind == "chat"]))
    cfg = BenchConfig(url, num_requests=case.num_requests, request_rates=(case.rate,), **common)
    run = run_benchmark(cfg).runs[0]
    return run.summary, tokens_per_event(run.records)


def _simulated(profile, case: Case, seed: int) -> dict[str, Any]:
    from services.bench.workloads import Workload
    from shared.sim.cluster import ClosedLoop, ClusterConfig, simulate
    from shared.sim.workload import bench_request, poisson_requests

    config = ClusterConfig()
    if case.workload == "interference":
        chat = Workload("chat", seed, prompt_tokens=case.input_len, output_tokens=case.output_len)
        long = Workload("long-doc", seed, prompt_tokens=LONG_LEN, output_tokens=LONG_OUT)
        arrivals, at, k = [], WARMUP_S, 0
        while at < case.duration_s:
            arrivals.append(bench_request(long, k, at))
            at, k = at + LONG_INTERVAL_S, k + 1
        closed = ClosedLoop(lambda i: bench_request(chat, 1_000_000 + i, 0.0), case.concurrency, case.duration_s)
        s = simulate(profile, config, arrivals, closed=closed, itl_from_s=WARMUP_S)
        return s["by_kind"]["chat"] | {"request_throughput": s["request_throughput"]}
    reqs = poisson_requests(case.workload, case.rate, seed, num_requests=case.num_requests,
                            prompt_tokens=case.input_len, output_tokens=case.output_len)
    return simulate(profile, config, reqs)


def _value(summary: dict[str, Any], metric: str, q: str | None) -> float:
    return summary[metric] if q is None else summary[metric][q]


def compare(cases=CASES, seed: int = 4242, quick_profile: bool = True) -> dict[str, Any]:
    """Profile, calibrate and run every case for real and in simulation; relative errors per metric."""
    from services.planner.calibrate import calibrate, engine_up_args, measure_stack
    from services.planner.profile import ProfileConfig, run_profile
    from services.up import add_up_args, start_stack, wait_healthy
    from shared.model.hub import resolve_model_path
    from shared.sim.cost import Profile
    from shared.transport.servers import free_port

    t0 = time.perf_counter()
    from shared.cli_args import add_engine_args, engine_config

    engine_args = argparse.ArgumentParser()
    add_engine_args(engine_args)  # the workers' engine defaults, one thread each (2 engines on 2 cores)
    engine = engine_config(engine_args.parse_args(["--threads", "1"]))
    engine_profile = Profile.from_json(run_profile(ProfileConfig(engine=engine, quick=quick_profile)))
    gguf = str(resolve_model_path(None))
    parser = argparse.ArgumentParser()
    add_up_args(parser)
    args = parser.parse_args(["--port", str(free_port()), "--workdir", tempfile.mkdtemp(prefix="pdserve-acc-"),
                              *engine_up_args(engine)])
    stack, url = start_stack(args)
    rows = []
    try:
        wait_healthy(stack, url, timeout=180)
        profile = calibrate(engine_profile, measure_stack(url, gguf))
        for i, case in enumerate(cases):
            real, tau = _real(url, gguf, case, seed + i)
            sim = _simulated(profile.with_tokens_per_event(tau), case, seed + i)
            row = {"case": case.name, "tokens_per_event": tau}
            for metric, q in METRICS:
                key = metric.replace("_ms", "") + (f"_{q}" if q else "")
                r, s = _value(real, metric, q), _value(sim, metric, q)
                row[key] = {"real": r, "sim": s, "error": (s - r) / r if r else math.inf}
            rows.append(row)
            log.info("%s (%.2f tokens per event): %s", case.name, tau,
                     {k: f"{v['error']:+.0%}" for k, v in row.items() if k not in INPUTS})
    finally:
        stack.stop()
    return {"rows": rows, "calibration": profile.meta.get("calibration"), "wall_s": time.perf_counter() - t0}


def format_table(result: dict[str, Any]) -> str:
    keys = [k for k in result["rows"][0] if k not in INPUTS]
    lines = ["| case | tokens/event | " + " | ".join(keys) + " |", "|---" * (len(keys) + 2) + "|"]
    for row in result["rows"]:
        cells = [f"{row[k]['sim']:.4g} / {row[k]['real']:.4g} ({row[k]['error']:+.0%})" for k in keys]
        lines.append(f"| {row['case']} | {row.get('tokens_per_event', 1.0):.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.planner.accuracy")
    p.add_argument("--out", default=None)
    p.add_argument("--full-profile", action="store_true", help="the full profile grid (slower) instead of --quick")
    args = p.parse_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    result = compare(quick_profile=not args.full_profile)
    print("cells: sim / real (error)\n" + format_table(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
