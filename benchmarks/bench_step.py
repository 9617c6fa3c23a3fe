"""Decode step time of the default engine at batch 1 and 8 (128-token prompts, 72 timed steps, best
of 3), speculation off: a quick check of a kernel change, not a comparison (bench_model.py is).

    .venv/bin/python benchmarks/bench_step.py [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch

from shared.config import EngineConfig, SpecConfig
from shared.engine.engine import LLMEngine
from shared.model.sampling import SamplingParams

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
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = LLMEngine.from_config(EngineConfig(num_kv_blocks=512, speculative=SpecConfig(mode="off")))
    for batch in (1, 8):
        best = min(step_seconds(engine, batch, f"b{batch}-{rep}") for rep in range(3))
        print(f"batch {batch}: step {best * 1e3:.2f} ms ({batch / best:.1f} tok/s)")


if __name__ == "__main__":
    main()
