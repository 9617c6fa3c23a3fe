"""Speculative decoding through `pdserve up`: the default (`--speculative suffix`) beside
`--speculative off`, A B B A, on `pdserve bench`'s grounded and open workloads at a concurrency
sweep. Each cell sends its own seeded requests (fresh prompts: the suffix cache has not seen them),
to a fresh stack per pass; greedy, natural ends (the same tokens with and without speculation).

    python benchmarks/bench_spec.py [--concurrency 1,2,4,8,16] [--workloads grounded,open] [--json PATH]

Any two `pdserve up` configurations can be compared the same way: `--a-args` / `--b-args` (the
defaults: `--speculative off` / `--speculative suffix`), e.g. core sharing on and off:

    python benchmarks/bench_spec.py --a-args=--no-core-share --b-args= --workloads chat,open

Reports per cell: output tokens/s, TPOT p50/mean (decode ms per token after the first), and for
speculation the proposals verified and accepted (the decode worker's Prometheus counters).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.bench.runner import BenchConfig, run_benchmark  # noqa: E402
from services.up import add_up_args, start_stack, wait_healthy  # noqa: E402
from shared.transport.servers import free_port  # noqa: E402

ORDER = ("A", "B", "B", "A")
COUNTERS = ("pdserve_spec_decode_num_draft_tokens_total", "pdserve_spec_decode_num_accepted_tokens_total",
            "pdserve_spec_decode_num_drafts_total")


def spec_counters(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out = dict.fromkeys(COUNTERS, 0.0)
    for line in text.splitlines():
        for name in COUNTERS:
            if line.startswith(name + "{") and 'service="decode"' in line:
                out[name] += float(line.rsplit(" ", 1)[1])
    return out


def run_pass(mode: str, up_args: list[str], concurrency: list[int], workloads: list[str], workdir: Path) -> dict:
    parser = argparse.ArgumentParser()
    add_up_args(parser)
    args = parser.parse_args(["--port", str(free_port()), "--workdir", str(workdir), *up_args])
    stack, url = start_stack(args)
    cells = {}
    try:
        wait_healthy(stack, url, timeout=180)
        run_benchmark(BenchConfig(base_url=url, endpoint="chat", num_requests=2, max_concurrency=2, seed=99,
                                  output_tokens=(8, 8), progress=False))  # warm-up
        for wl in workloads:
            for c in concurrency:
                time.sleep(1.5)  # the heartbeat publishes the counters: let the last cell's land
                before = spec_counters(url)
                res = run_benchmark(BenchConfig(base_url=url, endpoint="chat", workload=wl, num_requests=max(4, 2 * c),
                                                max_concurrency=c, seed=1000 * c + len(wl), ignore_eos=False,
                                                progress=False, label=f"{mode} {wl} c{c}"))
                time.sleep(1.5)
                after = spec_counters(url)
                s = res.runs[0].summary
                if s["failed"]:
                    raise RuntimeError(f"{mode} {wl} c{c}: {s['failed']} requests failed: {s['failures']}")
                drafted = after[COUNTERS[0]] - before[COUNTERS[0]]
                accepted = after[COUNTERS[1]] - before[COUNTERS[1]]
                drafts = after[COUNTERS[2]] - before[COUNTERS[2]]
                cells[f"{wl} c{c}"] = {
                    "output_tok_s": s["output_throughput"], "tpot_p50_ms": s["tpot_ms"]["p50"],
                    "tpot_mean_ms": s["tpot_ms"]["mean"], "output_tokens": s["total_output_tokens"],
                    "draft_tokens": drafted, "accepted_tokens": accepted, "drafts": drafts,
                }
                print(f"{mode:7s} {wl:9s} c{c:<3d} {s['output_throughput']:7.1f} tok/s  TPOT p50 "
                      f"{s['tpot_ms']['p50']:6.2f} ms  drafted {drafted:6.0f} accepted {accepted:6.0f}", flush=True)
    finally:
        stack.stop()
    return cells


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="1,2,4,8,16")
    p.add_argument("--workloads", default="grounded,open")
    p.add_argument("--workdir", default="/tmp/pdserve-bench-spec")
    p.add_argument("--json", default=None)
    p.add_argument("--a-args", default="--speculative off", help="pdserve up arguments of configuration A")
    p.add_argument("--b-args", default="--speculative suffix", help="… of configuration B")
    args = p.parse_args()
    up_args = {"A": args.a_args.split(), "B": args.b_args.split()}
    concurrency = [int(c) for c in args.concurrency.split(",")]
    workloads = args.workloads.split(",")
    passes = [(mode, run_pass(mode, up_args[mode], concurrency, workloads, Path(args.workdir) / f"pass{i}-{mode}"))
              for i, mode in enumerate(ORDER)]
    print(f"\nA: {args.a_args!r}  B: {args.b_args!r}")
    print("\ncell            A tok/s     B tok/s    B÷A     TPOT A/B ms      acceptance  accepted/draft  per draft")
    table = {}
    for cell in passes[0][1]:
        a = [c[cell] for m, c in passes if m == "A"]
        b = [c[cell] for m, c in passes if m == "B"]
        a_tps = statistics.mean(x["output_tok_s"] for x in a)
        b_tps = statistics.mean(x["output_tok_s"] for x in b)
        drafted = sum(x["draft_tokens"] for x in b)
        accepted = sum(x["accepted_tokens"] for x in b)
        drafts = sum(x["drafts"] for x in b)
        tpot_a = statistics.mean(x["tpot_mean_ms"] for x in a)
        tpot_b = statistics.mean(x["tpot_mean_ms"] for x in b)
        table[cell] = {"a_tok_s": a_tps, "b_tok_s": b_tps, "ratio": b_tps / a_tps,
                       "tpot_a_ms": tpot_a, "tpot_b_ms": tpot_b, "tpot_ratio": tpot_a / tpot_b,
                       "draft_tokens": drafted, "accepted_tokens": accepted,
                       "mean_accepted_per_draft": accepted / drafts if drafts else 0.0}
        rate = accepted / drafted if drafted else 0.0
        print(f"{cell:14s} {a_tps:9.1f} {b_tps:10.1f} {b_tps / a_tps:7.2f}x   {tpot_a:6.2f}/{tpot_b:5.2f}"
              f"      {rate:6.1%}    {accepted:.0f}/{drafted:.0f}  {accepted / drafts if drafts else 0:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"a_args": args.a_args, "b_args": args.b_args, "order": ORDER,
                                               "passes": passes, "table": table}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
