"""What tracing costs: the same chat load against `pdserve up` with tracing off and on (every request
sampled, exported over OTLP/HTTP to an in-process receiver), A B B A, one fresh stack per run.

    .venv/bin/python benchmarks/bench_tracing.py [--rounds 1] [--requests 64] [--concurrency 8]

Reports ITL p50/p99, TPOT p50 and output tok/s per run, and on/off ratios (median of the pairs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.up import add_up_args, start_stack, wait_healthy  # noqa: E402
from shared.telemetry.otlp_receiver import OTLPReceiver  # noqa: E402
from shared.transport.servers import free_port  # noqa: E402


def one_run(traced: bool, receiver: OTLPReceiver, args, seed: int) -> dict:
    """`args.where`: which services trace when on (all, or only the gateway / only the workers, to
    find where a cost comes from)."""
    parser = argparse.ArgumentParser()
    add_up_args(parser)
    work = tempfile.mkdtemp(prefix="bench-tracing-")
    flag = {"all": ["--otlp-endpoint", receiver.url], "gateway": [f"--gateway-arg=--otlp-endpoint={receiver.url}"],
            "workers": [f"--worker-arg=--otlp-endpoint={receiver.url}"]}[args.where]
    argv = ["--port", str(free_port()), "--workdir", work, *args.up_arg] + (flag if traced else [])
    stack, url = start_stack(parser.parse_args(argv))
    try:
        wait_healthy(stack, url, timeout=180)
        out = Path(work) / "bench.json"
        subprocess.run([sys.executable, "-m", "services.cli", "bench", "--base-url", url, "--workload", "chat",
                        "--num-requests", str(args.requests), "--max-concurrency", str(args.concurrency),
                        "--seed", str(seed), "--no-progress", "--out", str(out)], check=True, capture_output=True)
        run = json.loads(out.read_text())["runs"][0]
    finally:
        stack.stop()
    s = run["summary"]
    ok = [r for r in run["records"] if r["status"] == "ok"]
    tokens_per_chunk = sum(r["output_tokens"] for r in ok) / max(1, sum(len(r["token_times_s"]) for r in ok))
    return {"itl_p50": s["itl_ms"]["p50"], "itl_p99": s["itl_ms"]["p99"], "tpot_p50": s["tpot_ms"]["p50"],
            "tok_s": s["output_throughput"], "tokens_per_chunk": tokens_per_chunk, "failed": s["failed"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--where", choices=["all", "gateway", "workers"], default="all",
                    help="which services trace in the 'on' runs")
    ap.add_argument("--up-arg", action="append", default=[],
                    help="extra `pdserve up` argument for every run, e.g. --up-arg=--speculative=off (one token "
                         "per step: ITL is then comparable run to run)")
    ap.add_argument("--json", help="write the runs here")
    args = ap.parse_args()
    receiver = OTLPReceiver()
    runs = []
    for r in range(args.rounds):
        for traced in (False, True, True, False):
            before = len(receiver.spans)
            res = one_run(traced, receiver, args, seed=r)  # the same workload in each of a round's runs
            res |= {"traced": traced, "spans": len(receiver.spans) - before}
            runs.append(res)
            print(json.dumps(res), flush=True)
    off = [x for x in runs if not x["traced"]]
    on = [x for x in runs if x["traced"]]
    print("| measure | off (median) | on (median) | on / off (median of pairs) |")
    print("|---|---|---|---|")
    for key in ("itl_p50", "itl_p99", "tpot_p50", "tok_s", "tokens_per_chunk"):
        ratios = [b[key] / a[key] for a, b in zip(off, on)]
        print(f"| {key} | {statistics.median(x[key] for x in off):.1f} | {statistics.median(x[key] for x in on):.1f} "
              f"| {statistics.median(ratios):.3f} ({min(ratios):.3f}–{max(ratios):.3f}) |")
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
