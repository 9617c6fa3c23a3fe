"""What per-token features cost in decode: tok/s of the default engine with and without them
(log-probabilities, seeded sampling, a JSON-schema constraint), at batch 1 and 16 (128-token prompts, 64 timed steps, speculation off: one token a step), each variant
measured beside plain greedy decoding in A B B A order, on the same engine.

    .venv/bin/python benchmarks/bench_sampling.py [--threads 2] [--rounds 2] [--variants logprobs-5,json-schema]

The constraint: a JSON array of at least 40 {"name", "age"} objects, which cannot end inside the
timed steps, so every row computes its grammar mask at every step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from shared.config import EngineConfig, SpecConfig
from shared.engine.engine import LLMEngine
from shared.model.sampling_params import Constraint, SamplingParams

WARMUP, STEPS = 8, 64
PLAIN = {"temperature": 0.0}
VARIANTS: dict[str, dict] = {
    "logprobs-0": {"temperature": 0.0, "logprobs": 0},  # the sampled token's only
    "logprobs-5": {"temperature": 0.0, "logprobs": 5},
    "logprobs-20": {"temperature": 0.0, "logprobs": 20},
    "sampled": {"temperature": 0.8, "top_p": 0.95, "seed": 1},  # seeded top-p sampling
    "temperature": {"temperature": 0.8},  # the whole vocabulary
    "top-k": {"temperature": 0.8, "top_k": 40},
    "json-schema": {"temperature": 0.0, "constraint": Constraint("json", json.dumps({
        "type": "array", "minItems": 40, "items": {
            "type": "object", "required": ["name", "age"], "additionalProperties": False,
            "properties": {"name": {"type": "string", "maxLength": 12},
                           "age": {"type": "integer", "minimum": 0, "maximum": 120}}}}))},
}


def tokens_per_second(engine: LLMEngine, batch: int, params: dict, tag: str) -> float:
    prompt = list(range(100, 228))
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", prompt, SamplingParams(max_tokens=WARMUP + STEPS + 1, ignore_eos=True,
                                                                **params))
    steps, t0, tokens = 0, 0.0, 0
    while engine.has_unfinished():
        outs = engine.step()
        steps += 1
        if steps > WARMUP:
            tokens += sum(len(o.new_token_ids) for o in outs)
        if steps == WARMUP:
            t0 = time.perf_counter()
    assert tokens == batch * (steps - WARMUP), f"{tokens} tokens in {steps - WARMUP} steps: a row ended early"
    return tokens / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2, help="A B B A rounds per cell")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = LLMEngine.from_config(EngineConfig(num_kv_blocks=512, speculative=SpecConfig(mode="off")))
    print("| variant | batch | plain tok/s | with tok/s | ratio (median of pairs, range) |")
    print("|---|---|---|---|---|")
    for name in args.variants.split(","):
        for batch in map(int, args.batches.split(",")):
            plain, other = [], []
            for r in range(args.rounds):
                for which in ("A", "B", "B", "A"):
                    params = PLAIN if which == "A" else VARIANTS[name]
                    rate = tokens_per_second(engine, batch, params, f"{name}-{batch}-{r}-{which}-{len(plain) + len(other)}")
                    (plain if which == "A" else other).append(rate)
            ratios = [o / p for o, p in zip(other, plain)]
            print(f"| {name} | {batch} | {statistics.median(plain):.1f} | {statistics.median(other):.1f} | "
                  f"{statistics.median(ratios):.2f} ({min(ratios):.2f}–{max(ratios):.2f}) |", flush=True)


if __name__ == "__main__":
    main()
