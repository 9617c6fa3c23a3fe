"""The KV handoff as a user sees it: the gap between a long prompt's first and second token.

Starts `pdserve up` as `services.planner.calibrate` does (one thread a worker, on a free port),
sends 4 warm-up requests, then 12 of PROMPT prompt tokens and 12 output tokens, one at a time, and
prints one JSON line: the mean first gap (token 1 is prefill's, token 2 decode's: the KV moved in
between), the mean of the later gaps, and the mean of each `usage.timing_ms` part
(kv_transfer = prefill's write + decode's read).

    .venv/bin/python benchmarks/first_gap.py LABEL [PROMPT]          # PROMPT: 768 by default

Alternate checkouts (A B B A), each run from its own directory with PYTHONPATH set to it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile

from services.bench.runner import BenchConfig, run_benchmark
from services.planner.calibrate import engine_up_args
from services.up import add_up_args, start_stack, wait_healthy
from shared.cli_args import add_engine_args, engine_config
from shared.model.hub import resolve_model_path
from shared.transport.servers import free_port


def main() -> None:
    label, prompt = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 768
    engine_parser = argparse.ArgumentParser()
    add_engine_args(engine_parser)
    engine = engine_config(engine_parser.parse_args(["--threads", "1"]))
    up_parser = argparse.ArgumentParser()
    add_up_args(up_parser)
    args = up_parser.parse_args(["--port", str(free_port()), "--workdir", tempfile.mkdtemp(prefix="pdserve-gap-"),
                                 *engine_up_args(engine)])
    gguf = str(resolve_model_path(None))
    stack, url = start_stack(args)

    def bench(n: int, output: int, seed: int):
        return run_benchmark(BenchConfig(url, workload="chat", num_requests=n, max_concurrency=1,
                                         prompt_tokens=(prompt, prompt), output_tokens=(output, output),
                                         tokenizer=gguf, progress=False, seed=seed)).runs[0].records

    try:
        wait_healthy(stack, url, timeout=180)
        bench(4, 8, 1)
        first, later, parts = [], [], {}
        for seed in (11, 12):
            for record in bench(6, 12, seed):
                t = record.token_times_s
                first.append(t[1] - t[0])
                later += [b - a for a, b in zip(t[1:], t[2:])]
                for key, ms in record.timing_ms.items():
                    if isinstance(ms, int | float):
                        parts.setdefault(key, []).append(ms)
        print(json.dumps({"label": label, "prompt_tokens": prompt,
                          "first_gap_ms": round(1e3 * statistics.mean(first), 1),
                          "later_gap_ms": round(1e3 * statistics.mean(later), 1),
                          **{f"{key}_ms": round(statistics.mean(v), 2) for key, v in parts.items()}}))
    finally:
        stack.stop()


if __name__ == "__main__":
    main()
