"""Routing policies and scenario presets side by side (BENCHMARKS.md, issue 14).

Each turn starts a fresh `pdserve up` (cold caches), runs one `pdserve bench` workload against it,
and stops it; turns alternate A B … B A so drift (thermal, page cache, a noisy neighbour) falls on
every arm alike.

    routing   --topology colocated  2 colocated workers, each its own engine cache (--num-kv-blocks)
              --topology hosts      2 played hosts: a kvstore (--kv-slots) + a prefill worker each,
                                    1 decode worker; KV between the hosts over NATS
              --trace doc-qa        reuse-heavy: users each with their own document, question after
                                    question (an odd number of users, so round-robin does not
                                    partition them by accident)
              --trace chat          zero reuse: every prompt distinct
              --topology conditional --arm-flag=--conditional-threshold --arms 1,256,1024
                                    where conditional mode's threshold should be on this machine
    presets   --presets chat,long-doc,batch,platform on the scenario given by --trace

    .venv/bin/python benchmarks/bench_routing.py --topology colocated --trace doc-qa \
        --arms cache-aware,round-robin,least-loaded --out benchmarks/results/routing-colocated-docqa.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from services.bench.metrics import SLO  # noqa: E402
from services.bench.runner import BenchConfig, run_benchmark  # noqa: E402
from shared.transport.servers import free_port  # noqa: E402

TOPOLOGIES = {
    "colocated": ["--mode", "colocated", "--decode", "2"],
    "hosts": ["--mode", "disaggregated", "--hosts", "2", "--prefill", "2", "--decode", "1"],
    "conditional": ["--mode", "conditional"],  # 1 prefill + 1 decode: where each prompt is prefilled
}


def trace_config(args, url: str) -> BenchConfig:
    slo = SLO(args.slo_ttft_ms, args.slo_tpot_ms)
    common = dict(base_url=url, endpoint="chat", num_requests=args.num_requests, max_concurrency=args.concurrency,
                  seed=args.seed, slo=slo, progress=False)
    if args.trace == "doc-qa":
        return BenchConfig(workload="doc-qa", prefix_tokens=args.doc_tokens, users=args.users,
                           output_tokens=(16, 48), **common)
    if args.trace == "chat":
        return BenchConfig(workload="chat", output_tokens=(24, 48), **common)
    if args.trace == "long-doc":
        return BenchConfig(workload="long-doc", prompt_tokens=(1200, 2000), output_tokens=(32, 64), **common)
    raise SystemExit(f"unknown trace {args.trace}")


def up_args(args, arm: str) -> list[str]:
    if args.presets:
        return ["--preset", arm, "--kv-slots", str(args.kv_slots)]
    return [*TOPOLOGIES[args.topology], args.arm_flag, arm, "--kv-slots", str(args.kv_slots),
            "--worker-arg=--num-kv-blocks", f"--worker-arg={args.num_kv_blocks}", *args.up_arg]


def turn(args, arm: str) -> dict:
    port = free_port()
    workdir = Path(tempfile.mkdtemp(prefix=f"bench-routing-{arm}-"))
    log = open(workdir / "up.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--port", str(port), "--workdir", str(workdir),
                             *up_args(args, arm)], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{arm}: pdserve up did not come up (logs in {workdir})")
            time.sleep(0.5)
        time.sleep(1.0)  # the gateway hears every worker's stats (its router's candidates)
        t0 = time.monotonic()
        result = run_benchmark(trace_config(args, url))
        s = result.runs[0].summary
        jobs = [line for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
                if line.startswith("pdserve_router_jobs_total")]
        row = {"arm": arm, "wall_s": round(time.monotonic() - t0, 1), "completed": s["completed"],
               "failed": s["failed"], "ttft_p50_ms": s["ttft_ms"]["p50"], "ttft_p90_ms": s["ttft_ms"]["p90"],
               "ttft_p99_ms": s["ttft_ms"]["p99"], "tpot_p50_ms": s["tpot_ms"]["p50"] if s["tpot_ms"] else None,
               "itl_p90_ms": s["itl_ms"]["p90"] if s["itl_ms"] else None,
               "prefix_hit_rate": s["prefix_hit_rate"], "output_tok_s": s["output_throughput"],
               "goodput_req_s": s["goodput"]["request_goodput"] if s["goodput"] else None,
               "slo_attainment_pct": s["goodput"]["attainment_pct"] if s["goodput"] else None, "routes": jobs}
        print(json.dumps({k: v for k, v in row.items() if k != "routes"}), flush=True)
        return row
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--topology", choices=sorted(TOPOLOGIES), default="colocated")
    p.add_argument("--trace", default="doc-qa", choices=["doc-qa", "chat", "long-doc"])
    p.add_argument("--arms", default="cache-aware,round-robin", help="router policies, in A B order")
    p.add_argument("--presets", action="store_true", help="--arms are preset names, not router policies")
    p.add_argument("--arm-flag", default="--router", help="the `pdserve up` option the arms are values of")
    p.add_argument("--up-arg", action="append", default=[], help="another `pdserve up` argument for every arm")
    p.add_argument("--rounds", type=int, default=1, help="A B B A repeated this often")
    p.add_argument("--num-requests", type=int, default=84)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--users", type=int, default=7)
    p.add_argument("--doc-tokens", type=int, default=800)
    p.add_argument("--num-kv-blocks", type=int, default=256, help="each worker's engine cache, in 16-token blocks")
    p.add_argument("--kv-slots", type=int, default=256, help="each kvstore's blocks")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=150.0)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    order = [a for _ in range(args.rounds) for a in arms + arms[::-1]]
    print(f"# {' '.join(sys.argv[1:])}\n# turns: {' '.join(order)}  ({os.cpu_count()} CPUs)", flush=True)
    rows = [turn(args, arm) for arm in order]
    summary = {}
    for arm in arms:
        mine = [r for r in rows if r["arm"] == arm]
        summary[arm] = {key: statistics.median(r[key] for r in mine) if all(r[key] is not None for r in mine)
                        else None
                        for key in ("ttft_p50_ms", "ttft_p90_ms", "prefix_hit_rate", "output_tok_s", "goodput_req_s",
                                    "slo_attainment_pct", "tpot_p50_ms", "itl_p90_ms")}
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "turns": rows, "median": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
