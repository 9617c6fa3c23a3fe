"""`pdserve` — the command line.

    pdserve up [--mode M --prefill N --decode M]   NATS, Valkey, kvstore, workers, gateway on this machine
    pdserve gateway|prefill|decode|kvstore …       one service on its own (how docker-compose runs them)
    pdserve model pull                             fetch the default model into the cache
    pdserve model export-tokenizer DIR             its tokenizer as a Hugging Face tokenizer directory
    pdserve cost BENCH.json [--compare OTHER.json] what a load cost per phase (or --url a live gateway)
    pdserve generate "prompt" [--chat]             stream the model's answer to the terminal
    pdserve bench --base-url URL [--workload W]    load any OpenAI-compatible server, report TTFT/TPOT/ITL/goodput
    pdserve profile | simulate | plan              measure this machine; simulate a fleet; size the pools
    pdserve planner                                the live planner on Kubernetes: replica counts per pool

Environment variables are read here, once, and passed on as plain values.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from shared.cli_args import add_engine_args, engine_config

log = logging.getLogger("pdserve")


def cmd_model_pull(args: argparse.Namespace) -> int:
    from shared.model.hub import pull_default_model

    print(pull_default_model(force=args.force))
    return 0


def cmd_model_export_tokenizer(args: argparse.Namespace) -> int:
    from shared.model.hub import resolve_model_path
    from shared.model.tokenizer import Tokenizer

    for path in Tokenizer.from_model(resolve_model_path(args.model)).save(args.directory):
        print(path)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from shared.engine.engine import LLMEngine
    from shared.kernels import cpu_ext
    from shared.model.chat_template import render_chat
    from shared.model.sampling_params import SamplingParams

    engine = LLMEngine.from_config(engine_config(args))
    if cpu_ext.BUILD_SECONDS is not None:
        print(f"[cold start: compiled pdserve's CPU kernels in {cpu_ext.BUILD_SECONDS:.0f} s, cached for later runs]",
              file=sys.stderr)
    tok = engine.tokenizer
    if args.chat or (not args.raw and tok.chat_template):  # an instruct model asked raw often just ends
        text = render_chat(tok.chat_template, [{"role": "user", "content": args.prompt}], add_generation_prompt=True)
        prompt_ids = tok.encode(text, add_special_tokens=False)
    else:
        prompt_ids = tok.encode(args.prompt)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=args.stop or [])
    engine.add_request("cli", prompt_ids, params)
    start = time.perf_counter()
    first = None
    n = 0
    out = None
    while engine.has_unfinished():
        for out in engine.step():
            first = first or time.perf_counter()
            n += len(out.new_token_ids)
            sys.stdout.write(out.text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    end = time.perf_counter()
    if args.stats and first is not None:
        tpot = (end - first) / max(1, n - 1)
        print(f"[{len(prompt_ids)} prompt tokens, {n} generated, finish={out.finish_reason}; "
              f"TTFT {1000 * (first - start):.0f} ms, {1 / tpot if n > 1 else 0:.1f} tok/s decode]", file=sys.stderr)
    return 0


SERVICES = ("gateway", "prefill", "decode", "kvstore")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="LLM serving with prefill and decode disaggregated")
    parser.add_argument("--log-level", default=os.environ.get("PDSERVE_LOG_LEVEL", "WARNING"))
    sub = parser.add_subparsers(dest="command", required=True)
    for name in SERVICES:
        sub.add_parser(name, help=f"run one {name} service (see `pdserve {name} --help`)", add_help=False)

    from services.up import add_up_args, cmd_up

    up = sub.add_parser("up", help="run everything on this machine (the embedded default)")
    add_up_args(up)
    up.set_defaults(func=cmd_up)

    model = sub.add_parser("model", help="manage model files").add_subparsers(dest="model_command", required=True)
    pull = model.add_parser("pull", help="fetch the default model (SmolLM2-135M-Instruct) into the cache")
    pull.add_argument("--force", action="store_true")
    pull.set_defaults(func=cmd_model_pull)
    export = model.add_parser("export-tokenizer", help="write the model's tokenizer as a Hugging Face tokenizer "
                              "directory (tokenizer.json, tokenizer_config.json with the chat template), for "
                              "clients that count tokens locally")
    export.add_argument("directory")
    export.add_argument("--model", default=None, help="a .gguf file or model directory (default: the default model)")
    export.set_defaults(func=cmd_model_export_tokenizer)

    gen = sub.add_parser("generate", help="stream the model's answer to a prompt")
    gen.add_argument("prompt")
    mode = gen.add_mutually_exclusive_group()
    mode.add_argument("--chat", action="store_true",
                      help="wrap the prompt in the model's chat template (the default when the model has one)")
    mode.add_argument("--raw", action="store_true", help="continue the prompt as plain text, no chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--stats", action="store_true", help="print TTFT and decode speed to stderr")
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    from services.bench.__main__ import add_bench_args, cmd_bench

    bench = sub.add_parser("bench", help="load an OpenAI-compatible server (pdserve, llama-server, vLLM) and "
                                         "report TTFT, TPOT, ITL, throughput and goodput")
    add_bench_args(bench)
    bench.set_defaults(func=cmd_bench)

    from services.bench.cost import add_cost_args, cmd_cost

    cost = sub.add_parser("cost", help="the cost of a load per phase (prefill-seconds, decode-seconds, KV moved), "
                                       "from a bench JSON or a live gateway; --compare for colocated vs disaggregated")
    add_cost_args(cost)
    cost.set_defaults(func=cmd_cost)

    from services.planner.cli import add_planner_commands

    add_planner_commands(sub)  # profile, simulate, plan
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in SERVICES:  # hand the rest of the command line to the service itself
        import importlib

        return importlib.import_module(f"services.{argv[0]}.__main__").main(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:  # bad input: a clear message, not a traceback
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
