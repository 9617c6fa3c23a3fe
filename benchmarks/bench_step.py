"""Decode step time of the default engine at batch 1 and 8 (128-token prompts, 72 timed steps, best
of 3), speculation off: a quick check of a kernel change, not a comparison (bench_model.py is).
With --amx, every measure is taken with the tile unit on and off in turns (A B B A, best of each)
and a cold prefill of 512 and 2,000 tokens is added: what AMX buys on this machine.

With --contexts, the batch-1 step from each context given instead (bench_model's decode measure,
32 steps, a fresh random prompt each time, `--repeats` times a context, interleaved): what a change
to attention does, one process per build, builds alternated. `--long` adds, at the last context, the
step of 8 sequences and a cold prefill of that many tokens.

    .venv/bin/python benchmarks/bench_step.py [--threads 2] [--amx | --contexts 128,2000 [--repeats 3] [--long]]
"""

from __future__ import annotations

import argparse
import time

import torch

from bench_model import decode_step_seconds, prefill_seconds  # benchmarks/, the script's own directory

from shared.config import EngineConfig, SpecConfig
from shared.engine.engine import LLMEngine
from shared.kernels import cpu_ext
from shared.model.sampling_params import SamplingParams

WARMUP = 8


def step_seconds(engine: LLMEngine, batch: int, tag: str) -> float:
    prompt = list(range(100, 228))
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", prompt, SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True))
    steps, t0 = 0, 0.0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if steps == WARMUP:
            t0 = time.perf_counter()
    return (time.perf_counter() - t0) / (steps - WARMUP)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--amx", action="store_true", help="each measure with AMX on and off, A B B A")
    parser.add_argument("--contexts", default=None, help="batch-1 step from these contexts, e.g. 128,2000")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--long", action="store_true", help="with --contexts: batch 8 and prefill at the last one")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.contexts:
        contexts = [int(c) for c in args.contexts.split(",")]
        engine = LLMEngine.from_config(EngineConfig(num_threads=args.threads, num_kv_blocks=2048, max_num_seqs=64,
                                                    max_num_batched_tokens=2048, speculative=SpecConfig(mode="off")))
        for rep in range(args.repeats):
            line = [f"context {c}: {decode_step_seconds(engine, 1, c, seed=rep * 100 + i) * 1e3:.2f} ms"
                    for i, c in enumerate(contexts)]
            if args.long:
                c = contexts[-1]
                line.append(f"batch 8 at {c}: {decode_step_seconds(engine, 8, c, seed=rep * 100 + 50) * 1e3:.2f} ms")
                line.append(f"prefill {c}: {c / prefill_seconds(engine, c, seed=rep * 100 + 60):.0f} tok/s")
            print("  ".join(line), flush=True)
        return
    engine = LLMEngine.from_config(EngineConfig(num_kv_blocks=512, speculative=SpecConfig(mode="off")))
    if not args.amx:
        for batch in (1, 8):
            best = min(step_seconds(engine, batch, f"b{batch}-{rep}") for rep in range(3))
            print(f"batch {batch}: step {best * 1e3:.2f} ms ({batch / best:.1f} tok/s)")
        return
    ext = cpu_ext.load()
    if ext is None or not ext.amx_available():
        raise SystemExit("no AMX here (the CPU or the OS does not offer it, or PDSERVE_AMX=0)")
    measures = [(f"decode batch {b}", b, lambda turn, b=b: step_seconds(engine, b, f"b{b}-amx-{turn}"))
                for b in (1, 8, 16, 32)]
    # a fresh prompt a turn (bench_model's seeded random prompts, the prefix cache reset)
    measures += [(f"prefill {n}", n, lambda turn, n=n: prefill_seconds(engine, n, seed=turn)) for n in (512, 2000)]
    try:
        for name, tokens, measure in measures:
            best = {True: float("inf"), False: float("inf")}
            for turn, on in enumerate((True, False, False, True)):
                ext.set_amx(on)
                best[on] = min(best[on], measure(turn))
            print(f"{name}: AMX {tokens / best[True]:.1f} tok/s, off {tokens / best[False]:.1f} tok/s "
                  f"({best[False] / best[True]:.2f}x)", flush=True)
    finally:
        ext.set_amx(True)


if __name__ == "__main__":
    main()
