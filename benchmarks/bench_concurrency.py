"""`pdserve up` (its defaults) against llama.cpp's llama-server under `pdserve bench` chat load at
several concurrencies, same GGUF, same 2 cores: issue 10's serving check (output tokens/s ≥
llama-server's at every point).

    .venv/bin/python benchmarks/bench_concurrency.py --concurrency 4,8,16 \\
        --json benchmarks/results/concurrency_vs_llama.json

Systems take turns A B B A (`--passes 2`: pdserve, llama, llama, pdserve), each started whole and
stopped before the next. Every turn sends the same seeded requests per concurrency (closed loop,
2 × concurrency of them; the chat workload: 100–300-token prompts, 128–256 output tokens, greedy),
so both systems produce comparable answers and a fresh server sees each prompt once. A ratio is
taken between adjacent turns (P L and L P), and the median and range are reported.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path

from compare_systems import SYSTEMS, CpuMonitor, RunningSystem, SystemSpec, find_llama_server

from services.bench.runner import BenchConfig, run_benchmark
from shared.model.hub import resolve_model_path
from shared.transport.servers import free_port

log = logging.getLogger("bench_concurrency")

PDSERVE = SystemSpec("pdserve", "pdserve up (defaults)", "pdserve", (), "its defaults: 1 prefill + 1 decode worker, "
                     "speculation and core sharing on")


def run_turn(spec: SystemSpec, model: Path, llama: Path, concurrencies: list[int], seed: int, workdir: Path) -> dict:
    t0 = time.perf_counter()
    system = RunningSystem(spec, model, llama, free_port(), workdir)
    out = {"system": spec.key, "command": system.command, "started_s": time.perf_counter() - t0, "cells": {}}
    try:
        warm = BenchConfig(system.url, workload="chat", num_requests=2, max_concurrency=2, output_tokens=(8, 8),
                           prompt_tokens=(50, 80), seed=seed - 1, progress=False)
        run_benchmark(warm)
        for c in concurrencies:
            config = BenchConfig(system.url, workload="chat", num_requests=2 * c, max_concurrency=c, seed=seed + c,
                                 progress=False, label=f"{spec.key} c{c}")
            monitor = CpuMonitor(system.pids)
            s = run_benchmark(config).runs[0].summary
            cell = {"output_tok_s": s["output_throughput"], "failed": s["failed"],
                    "ttft_p50_ms": s["ttft_ms"]["p50"], "tpot_p50_ms": s["tpot_ms"]["p50"],
                    "itl_p50_ms": s["itl_ms"]["p50"], "output_tokens": s["total_output_tokens"],
                    "system_cores": monitor.system_cores(), "other_cores": monitor.others_cores()}
            out["cells"][str(c)] = cell
            log.info("%s c%d: %.1f output tok/s, TTFT p50 %.0f ms, TPOT p50 %.1f ms, %.2f cores (others %.2f)",
                     spec.key, c, cell["output_tok_s"], cell["ttft_p50_ms"], cell["tpot_p50_ms"],
                     cell["system_cores"], cell["other_cores"])
    finally:
        system.stop()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="4,8,16")
    ap.add_argument("--passes", type=int, default=2, help="each pass is P L L P")
    ap.add_argument("--model", default=None)
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--seed", type=int, default=1000)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    logging.basicConfig(level="INFO", format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    model, llama = resolve_model_path(args.model), find_llama_server(args.llama_server)
    workdir = Path(tempfile.mkdtemp(prefix="pdserve-conc-"))
    specs = {"pdserve": PDSERVE, "llama": SYSTEMS["llama"]}
    turns = []
    for p in range(args.passes):
        for k, key in enumerate(("pdserve", "llama", "llama", "pdserve")):
            turns.append(run_turn(specs[key], model, llama, concurrencies, args.seed, workdir / f"{p}-{k}-{key}"))
    table = {}
    for c in map(str, concurrencies):
        ratios = []
        for a, b in zip(turns, turns[1:]):
            if a["system"] != b["system"]:
                p, l = (a, b) if a["system"] == "pdserve" else (b, a)
                ratios.append(p["cells"][c]["output_tok_s"] / l["cells"][c]["output_tok_s"])
        med = {key: statistics.median(t["cells"][c]["output_tok_s"] for t in turns if t["system"] == key)
               for key in specs}
        table[c] = {"pdserve_tok_s": med["pdserve"], "llama_tok_s": med["llama"],
                    "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}
        print(f"concurrency {c}: pdserve {med['pdserve']:.1f} tok/s, llama-server {med['llama']:.1f} tok/s, "
              f"ratio {table[c]['ratio_median']:.2f}× ({min(ratios):.2f}–{max(ratios):.2f})")
    if args.json:
        Path(args.json).write_text(json.dumps({"turns": turns, "table": table}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
