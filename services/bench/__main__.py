"""`pdserve bench` (also `python -m services.bench`): load an OpenAI-compatible server, report latencies.

    pdserve bench --base-url http://127.0.0.1:8000 --workload chat --num-requests 64 --request-rate 0.5,1,2 \
        --slo-ttft-ms 500 --slo-tpot-ms 60 --out results.json --plots plots/
    pdserve bench --workload interference --max-concurrency 8 --duration 30 --long-interval 5
    pdserve bench --dataset prompts.jsonl --max-concurrency 4 --endpoint chat
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from services.bench.workloads import WORKLOADS, parse_range


def _rates(text: str) -> tuple[float, ...]:
    return tuple(math.inf if r.strip() == "inf" else float(r) for r in text.split(","))


def _range(text: str) -> tuple[int, int]:
    try:
        return parse_range(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_bench_args(p: argparse.ArgumentParser) -> None:
    target = p.add_argument_group("target")
    target.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (…/v1 is appended)")
    target.add_argument("--model", default=None, help="model name to send (default: the first in /v1/models)")
    target.add_argument("--endpoint", default="completions", choices=["completions", "chat"],
                        help="/v1/completions or /v1/chat/completions")
    target.add_argument("--api-key", default=None)
    target.add_argument("--extra-body", default="{}", type=json.loads,
                        help='JSON merged into every request body, e.g. \'{"cache_prompt": false}\'')
    target.add_argument("--temperature", type=float, default=0.0)
    target.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                        help="let the model stop early (then fewer tokens than asked is not a cut-off)")
    target.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")

    load = p.add_argument_group("workload and load")
    load.add_argument("--workload", default="chat", choices=WORKLOADS)
    load.add_argument("--dataset", default=None, help='JSONL file: {"prompt": ..., "max_tokens": ...} per line')
    load.add_argument("--num-requests", type=int, default=None)
    load.add_argument("--duration", type=float, default=None, help="stop sending after this many seconds")
    load.add_argument("--request-rate", type=_rates, default=(math.inf,),
                      help="Poisson arrivals in req/s; a comma list is a sweep (default inf: all at once)")
    load.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--input-len", type=_range, default=None, help="prompt tokens, N or MIN-MAX (override)")
    load.add_argument("--output-len", type=_range, default=None, help="output tokens, N or MIN-MAX (override)")
    load.add_argument("--prefix-len", type=int, default=1200,
                      help="shared-prefix: tokens in the shared prefix; doc-qa: in each user's document")
    load.add_argument("--users", type=int, default=8, help="doc-qa: users, each asking about their own document")
    load.add_argument("--tokenizer", default=None, help="GGUF file or HF directory: exact prompt lengths")

    mix = p.add_argument_group("interference workload")
    mix.add_argument("--long-interval", type=float, default=5.0, help="a long-doc prompt every this many seconds")
    mix.add_argument("--long-input-len", type=_range, default=None)
    mix.add_argument("--long-output-len", type=_range, default=None)
    mix.add_argument("--warmup", type=float, default=3.0,
                     help="the first long prompt is sent, and chat ITLs are counted, from this second on")
    mix.add_argument("--phases", default="baseline,long",
                     help="baseline (chat only) and/or long (with long prompts), in this order")

    out = p.add_argument_group("SLOs and output")
    out.add_argument("--slo-ttft-ms", type=float, default=None)
    out.add_argument("--slo-tpot-ms", type=float, default=None)
    out.add_argument("--out", default=None, help="write the JSON report (summary + every request) here")
    out.add_argument("--plots", default=None, help="write PNG plots into this directory")
    out.add_argument("--no-progress", dest="progress", action="store_false")


def bench_config(args: argparse.Namespace):
    from services.bench.metrics import SLO
    from services.bench.runner import BenchConfig

    if not isinstance(args.extra_body, dict):
        raise ValueError("--extra-body must be a JSON object")
    return BenchConfig(
        base_url=args.base_url, model=args.model, endpoint=args.endpoint, workload=args.workload,
        dataset=args.dataset, num_requests=args.num_requests, duration_s=args.duration,
        request_rates=args.request_rate, max_concurrency=args.max_concurrency, seed=args.seed,
        prompt_tokens=args.input_len, output_tokens=args.output_len, prefix_tokens=args.prefix_len, users=args.users,
        long_interval_s=args.long_interval, long_prompt_tokens=args.long_input_len,
        long_output_tokens=args.long_output_len, warmup_s=args.warmup,
        interference_phases=tuple(x.strip() for x in args.phases.split(",") if x.strip()),
        temperature=args.temperature, ignore_eos=args.ignore_eos, extra_body=args.extra_body, api_key=args.api_key,
        request_timeout_s=args.request_timeout, slo=SLO(args.slo_ttft_ms, args.slo_tpot_ms),
        tokenizer=args.tokenizer, progress=args.progress,
    )


def cmd_bench(args: argparse.Namespace) -> int:
    from services.bench.report import format_result, write_json
    from services.bench.runner import run_benchmark

    result = run_benchmark(bench_config(args))
    print(format_result(result), flush=True)
    if args.out:
        write_json(result, args.out)
        print(f"results: {args.out}", file=sys.stderr)
    if args.plots:
        from services.bench.plots import write_plots

        for path in write_plots(result, args.plots):
            print(f"plot: {path}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    from services.cli import main as cli_main

    return cli_main(["bench", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
