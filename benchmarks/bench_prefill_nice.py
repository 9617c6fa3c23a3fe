"""Does a lower CPU priority for the prefill worker keep disaggregated decode smooth on a shared host?

    .venv/bin/python benchmarks/bench_prefill_nice.py [--rounds 2]

Runs bench_compare's interference measurement (8 chat streams, long-doc prompts arriving every 6 s,
the same seeded trace) against `pdserve up` disaggregated (1 prefill + 1 decode worker on this
machine's cores) with the prefill worker at nice 0 and at nice 10, interleaved A B B A; prints each
run's chat ITL p99 without / with long prompts and the ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.bench.runner import BenchConfig, run_benchmark  # noqa: E402
from services.up import add_up_args, start_stack, wait_healthy  # noqa: E402
from shared.transport.servers import free_port  # noqa: E402


def measure(nice: int, workdir: str) -> dict:
    os.environ["PDSERVE_PREFILL_NICE"] = str(nice)  # the stack's children inherit it
    parser = argparse.ArgumentParser()
    add_up_args(parser)
    args = parser.parse_args(["--port", str(free_port()), "--workdir", workdir, "--prefill", "1", "--decode", "1"])
    stack, url = start_stack(args)
    try:
        wait_healthy(stack, url)
        run_benchmark(BenchConfig(base_url=url, num_requests=2, max_concurrency=2, output_tokens=(8, 8),
                                  prompt_tokens=(50, 80), seed=100, progress=False))  # warm-up
        res = run_benchmark(BenchConfig(base_url=url, workload="interference", max_concurrency=8, duration_s=24.0,
                                        warmup_s=4.0, long_interval_s=6.0, seed=400, progress=False))
        return res.interference
    finally:
        stack.stop()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2, help="A B B A rounds: 2 → 4 runs")
    args = ap.parse_args()
    order = [0, 10, 10, 0] * (args.rounds // 2) + ([0, 10] if args.rounds % 2 else [])
    ratios: dict[int, list[float]] = {0: [], 10: []}
    with tempfile.TemporaryDirectory() as tmp:
        for i, nice in enumerate(order):
            r = measure(nice, f"{tmp}/run{i}")
            ratios[nice].append(r["ratio"])
            print(f"prefill nice {nice:2d}: chat ITL p99 {r['chat_itl_p99_ms_baseline']:.0f} ms without, "
                  f"{r['chat_itl_p99_ms_with_long']:.0f} ms with long prompts → ratio {r['ratio']:.2f}", flush=True)
    for nice, rs in ratios.items():
        print(f"prefill nice {nice:2d}: median ratio {statistics.median(rs):.2f} over {len(rs)} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
