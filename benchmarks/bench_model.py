"""Model-level benchmark: prefill and decode speed of the engine on the real model, with the memory
bandwidth of this machine measured in the same run so decode MBU can be stated.

    .venv/bin/python benchmarks/bench_model.py [--dtype float32|bfloat16] [--repeats 3] [--json out.json]

Prints a markdown table. Absolute numbers drift on shared machines: compare within one run.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time

import torch

from shared.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.model.sampling import SamplingParams


def measure_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Read bandwidth in GB/s: the best of a few full reductions over a large fp32 array."""
    x = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
    x.sum()  # fault the pages in
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def decode_weight_bytes(model, batch: int) -> int:
    """Bytes of weights one decode step of `batch` rows reads: every parameter and buffer, except
    that only one row per token is read from the embedding and rotary tables (so they don't count,
    unless the embedding doubles as the output head, which reads it whole), and an int8 layer reads
    either its int8 matrix or its dense one, depending on the batch."""
    from shared.model.quant import Int8Linear

    skip = {id(model.embed_tokens.weight), id(model.rope.cos), id(model.rope.sin)}
    for m in model.modules():
        if isinstance(m, Int8Linear):
            unused = (m.dense,) if batch < Int8Linear.DENSE_FROM_ROWS else (m.qweight, m.scale)
            skip |= {id(t) for t in unused}
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()] if id(t) not in skip}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    if model.lm_head is None:
        total += model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    return total


def random_prompt(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (n,), generator=g).tolist()


def bench_prefill(engine: LLMEngine, n_tokens: int, repeats: int) -> float:
    """Seconds to prefill an `n_tokens` prompt from cold (prefix cache reset each time)."""
    times = []
    for r in range(repeats):
        engine.pool.reset_prefix_cache()
        engine.add_request(f"prefill-{r}", random_prompt(n_tokens, r, engine.model.config.vocab_size),
                           SamplingParams(temperature=0.0, max_tokens=1))
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_decode(engine: LLMEngine, batch: int, context: int, steps: int) -> float:
    """Seconds per decode step for `batch` sequences at ~`context` tokens of context."""
    params = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)  # aborted after timing
    for i in range(batch):
        engine.add_request(f"dec-{batch}-{i}", random_prompt(context, 1000 + i, engine.model.config.vocab_size), params)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running + list(engine.scheduler.waiting)):
        engine.step()  # prefill everything first
    engine.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        outs = engine.step()
        assert len(outs) == batch, "every sequence decodes one token per step"
    dt = (time.perf_counter() - t0) / steps
    for i in range(batch):
        engine.abort(f"dec-{batch}-{i}")
    return dt


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default="int8", help="int8 | none")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--prefill-tokens", type=int, default=2000)
    ap.add_argument("--context", type=int, default=500)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    quant = None if args.quantization == "none" else args.quantization
    cfg = EngineConfig(model=args.model, dtype=args.dtype, quantization=quant, num_threads=args.threads, num_kv_blocks=1536,
                       max_num_seqs=64, max_num_batched_tokens=2048, enable_prefix_caching=False)
    engine = LLMEngine.from_config(cfg)
    mcfg = engine.model.config
    params = sum(p.numel() for p in engine.model.parameters())
    elem = torch.tensor([], dtype=cfg.torch_dtype).element_size()
    kv_bytes_per_token = mcfg.kv_values_per_token * elem
    bw = measure_bandwidth()

    results = {"dtype": args.dtype, "quantization": args.quantization, "threads": torch.get_num_threads(), "params": params,
               "bandwidth_GBps": bw, "decode": {}}
    prefill_s = bench_prefill(engine, args.prefill_tokens, args.repeats)
    results["prefill_tok_s"] = args.prefill_tokens / prefill_s
    for b in (int(x) for x in args.batches.split(",")):
        per_step = statistics.median(bench_decode(engine, b, args.context, args.steps) for _ in range(args.repeats))
        step_bytes = decode_weight_bytes(engine.model, b) + b * (args.context + args.steps / 2) * kv_bytes_per_token
        results["decode"][b] = {
            "step_ms": per_step * 1e3,
            "tok_s": b / per_step,
            "mbu": step_bytes / per_step / (bw * 1e9),
        }
    engine.pool.check_invariants()
    results["peak_rss_MiB"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    print(f"# pdserve engine, {mcfg.name}, {args.dtype} + {args.quantization} weights, {results['threads']} threads, torch {torch.__version__}")
    print(f"memory read bandwidth (1 GiB fp32 sum, best of 5): {bw:.1f} GB/s")
    print(f"weights read per decode step: {decode_weight_bytes(engine.model, 1) / 1e6:.0f} MB at batch 1, "
          f"{decode_weight_bytes(engine.model, 32) / 1e6:.0f} MB at batch 32; KV per token {kv_bytes_per_token / 1e3:.1f} KB\n")
    print("| measure | value |\n|---|---|")
    print(f"| prefill, {args.prefill_tokens}-token prompt | {results['prefill_tok_s']:.0f} tok/s "
          f"({prefill_s * 1e3:.0f} ms) |")
    for b, r in results["decode"].items():
        print(f"| decode, batch {b}, context ~{args.context} | {r['tok_s']:.1f} tok/s "
              f"({r['step_ms']:.1f} ms/step, MBU {100 * r['mbu']:.0f}%) |")
    print(f"| peak RSS | {results['peak_rss_MiB']:.0f} MiB |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
