"""The engine beside llama.cpp on the same GGUF and the same threads, alternated A B B A in one run.

    .venv/bin/python benchmarks/bench_model.py [--rounds 2] [--threads 2] [--json out.json]
                                               [--llama-bench PATH] [--no-peer] [--speculative MODE]

pdserve's engine (the default configuration: the file's weight blocks, the fused forward, bf16 KV;
speculation off unless --speculative says otherwise, so that a step is one token a sequence as in
llama-bench's tg) and `llama-bench` (built by `benchmarks/build_llama_server.sh`; its default
configuration, and `--repack 0` where that crashes: see llama_turn) take turns: pdserve, llama,
llama, pdserve, … so drift on a shared machine hits both alike. Measured each turn:

- decode tok/s at batch 1 with 128 and 2,000 tokens of context (llama-bench: tg128 at depth 0 and
  2,000), and pdserve's decode at batch 8, 16 and 32;
- prefill tok/s of a 512- and a 2,000-token prompt, from cold (llama-bench: pp512, pp2000);
- MBU at batch 1: the weight bytes one step reads (the file's blocks, the head whole) plus the KV
  bytes it reads, per second, over the read bandwidth measured in the same turn;
- `LLMEngine.generate` end to end (128 tokens, sampling, detokenization, stop checks) against the
  raw step rate: the engine's overhead.

Prints a markdown table of medians and pdserve ÷ llama ratios; `--json` writes every turn.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from shared.config import EngineConfig, SpecConfig
from shared.engine.engine import LLMEngine
from shared.model.hub import pdserve_home, resolve_model_path
from shared.model.quant import QuantLinear
from shared.model.sampling_params import SamplingParams

DECODE_STEPS = 32


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


def step_weight_bytes(model) -> int:
    """Weight bytes one decode step reads: every projection's blocks, the head whole (tied: the
    embedding matrix, of which the lookup reads one more row), the norms."""
    linears = {id(m): m for m in model.modules() if isinstance(m, QuantLinear)}
    total = sum(m.nbytes for m in linears.values())
    norms = [model.norm.weight] + [p for layer in model.layers
                                   for p in (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)]
    return total + sum(p.numel() * 4 for p in norms)


def random_prompt(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (n,), generator=g).tolist()


def prefill_seconds(engine: LLMEngine, n: int, seed: int) -> float:
    engine.pool.reset_prefix_cache()
    engine.add_request(f"pp{n}-{seed}", random_prompt(n, seed, engine.model.config.vocab_size),
                       SamplingParams(temperature=0.0, max_tokens=1))
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - t0


def decode_step_seconds(engine: LLMEngine, batch: int, context: int, seed: int) -> float:
    """Seconds per decode step of `batch` sequences starting at `context` tokens."""
    vocab = engine.model.config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)  # aborted after timing
    ids = [f"tg{batch}-{context}-{seed}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        engine.add_request(rid, random_prompt(context, seed * 1000 + i, vocab), params)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running + list(engine.scheduler.waiting)):
        engine.step()  # prefill everything first (not timed)
    engine.step()
    t0 = time.perf_counter()
    tokens = 0
    for _ in range(DECODE_STEPS):
        outs = engine.step()
        assert len(outs) == batch, "every sequence decodes in every step"
        tokens += sum(len(o.new_token_ids) for o in outs)
    dt = (time.perf_counter() - t0) / tokens * batch  # seconds per step of one token a sequence
    for rid in ids:
        engine.abort(rid)
    return dt


def generate_overhead(engine: LLMEngine, step_s: float, seed: int) -> float:
    """generate()'s time per token after the first, over the raw step time at batch 1 (1.0 = no overhead)."""
    prompt = random_prompt(128, seed, engine.model.config.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=DECODE_STEPS + 1, ignore_eos=True)
    engine.pool.reset_prefix_cache()
    t0 = time.perf_counter()
    engine.generate([prompt], params)
    total = time.perf_counter() - t0
    first = prefill_seconds(engine, 128, seed)  # the same prompt cold again: its prefill's share
    return (total - first) / DECODE_STEPS / step_s


def pdserve_turn(engine: LLMEngine, seed: int) -> dict:
    cfg = engine.model.config
    kv_per_token = cfg.kv_values_per_token * engine.kv_cache.data.element_size()
    weights = step_weight_bytes(engine.model)
    bw = measure_bandwidth()
    out: dict = {"bandwidth_GBps": bw}
    for ctx in (128, 2000):
        s = decode_step_seconds(engine, 1, ctx, seed)
        kv = (ctx + DECODE_STEPS / 2) * kv_per_token
        out[f"tg_b1_ctx{ctx}"] = 1 / s
        out[f"mbu_b1_ctx{ctx}"] = (weights + kv) / s / (bw * 1e9)
        if ctx == 128:
            out["generate_overhead"] = generate_overhead(engine, s, seed)
    for b in (8, 16, 32):
        out[f"tg_b{b}_ctx128"] = b / decode_step_seconds(engine, b, 128, seed)
    for n in (512, 2000):
        out[f"pp{n}"] = n / prefill_seconds(engine, n, seed)
    return out


def llama_bench(binary: str, model: Path, threads: int, args: list[str]) -> list[dict] | None:
    cmd = [binary, "-m", str(model), "-t", str(threads), "-r", "3", "-o", "json", *args]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        print(f"llama-bench {' '.join(args)} failed (exit {res.returncode}): {res.stderr.strip()[-300:]}", file=sys.stderr)
        return None
    return json.loads(res.stdout)


def llama_turn(binary: str, model: Path, threads: int) -> dict:
    """llama-bench's pp512, pp2000, tg128 and tg128 at depth 2,000 (tok/s, its own mean of 3 runs), in
    its default configuration; a run that crashes there is run again with `--repack 0` (its weights
    as the file has them, no repacking into the CPU's extra buffer types: on a CPU with AMX, its AMX
    matmul crashed on batches here) and named in `repack0`. tg128 is also measured with `--repack 0`."""
    out: dict = {"repack0": []}
    runs = [(["-p", "512,2000", "-n", "0"], None), (["-p", "0", "-n", "128"], 128), (["-p", "0", "-n", "128", "-d", "2000"], 2000),
            (["-p", "0", "-n", "128", "--repack", "0"], "128_repack0")]
    for args, ctx in runs:
        rows = llama_bench(binary, model, threads, args)
        fallback = rows is None and "--repack" not in args
        if fallback:
            rows = llama_bench(binary, model, threads, [*args, "--repack", "0"])
        for row in rows or []:
            key = f"pp{row['n_prompt']}" if row["n_gen"] == 0 else f"tg_b1_ctx{ctx}"
            out[key] = row["avg_ts"]
            if fallback:
                out["repack0"].append(key)
    return out


ROWS = [("tg_b1_ctx128", "decode, batch 1, context 128 (tok/s)"),
        ("tg_b1_ctx128_repack0", "decode, batch 1, context 128, llama.cpp `--repack 0` (tok/s)"), ("tg_b1_ctx2000", "decode, batch 1, context 2,000 (tok/s)"),
        ("mbu_b1_ctx128", "MBU, batch 1, context 128"), ("mbu_b1_ctx2000", "MBU, batch 1, context 2,000"),
        ("tg_b8_ctx128", "decode, batch 8 (tok/s)"), ("tg_b16_ctx128", "decode, batch 16 (tok/s)"),
        ("tg_b32_ctx128", "decode, batch 32 (tok/s)"), ("pp512", "prefill, 512 tokens (tok/s)"),
        ("pp2000", "prefill, 2,000 tokens (tok/s)"), ("generate_overhead", "generate() per token ÷ raw step"),
        ("bandwidth_GBps", "read bandwidth in the same turn (GB/s)")]


def report(turns: list[dict]) -> str:
    def med(system: str, key: str) -> float | None:
        vals = [t[key] for t in turns if t["system"] == system and key in t]
        return statistics.median(vals) if vals else None

    def ratio(key: str) -> str:
        rs = []  # turns pair up as (P, L), (L, P), …: one ratio per adjacent pair
        pkey = key.removesuffix("_repack0")  # pdserve has one configuration
        for a, b in zip(turns[::2], turns[1::2]):
            pd, ll = (a, b) if a["system"] == "pdserve" else (b, a)
            if ll["system"] == "llama" and pkey in pd and key in ll:
                rs.append(pd[pkey] / ll[key])
        return f"{statistics.median(rs):.2f}× ({min(rs):.2f}–{max(rs):.2f})" if rs else "–"

    lines = ["| measure | pdserve | llama.cpp | pdserve ÷ llama.cpp (adjacent turns: median, range) |", "|---|---|---|---|"]
    repack0 = sorted({k for t in turns for k in t.get("repack0", [])})
    for key, label in ROWS:
        p, q = med("pdserve", key.removesuffix("_repack0")), med("llama", key)
        if key in repack0:
            label += " (llama.cpp: `--repack 0`, its default crashed)"
        fmt = (lambda v: "–" if v is None else (f"{100 * v:.0f}%" if key.startswith("mbu") else f"{v:.2f}" if key == "generate_overhead" else f"{v:.1f}"))
        lines.append(f"| {label} | {fmt(p)} | {fmt(q)} | {ratio(key) if not key.startswith(('mbu', 'gen', 'band')) else '–'} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="A B B A rounds (each: two turns of each system)")
    ap.add_argument("--llama-bench", default=str(pdserve_home() / "llama.cpp" / "build" / "bin" / "llama-bench"))
    ap.add_argument("--no-peer", action="store_true", help="pdserve only")
    ap.add_argument("--json", default=None)
    ap.add_argument("--speculative", default="off", help="pdserve's speculation mode (default off: one token a step)")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    model_path = resolve_model_path(args.model)
    peer = not args.no_peer and os.access(args.llama_bench, os.X_OK)
    if not peer and not args.no_peer:
        print(f"no llama-bench at {args.llama_bench}: run benchmarks/build_llama_server.sh (pdserve only)", file=sys.stderr)
    # speculation off: llama-bench's tg is one token per step, and so is the step measured here (with
    # speculation a step may keep several tokens; bench_spec.py measures that through the server)
    engine = LLMEngine.from_config(EngineConfig(model=str(model_path), num_threads=args.threads, num_kv_blocks=2048,
                                                max_num_seqs=64, max_num_batched_tokens=2048,
                                                speculative=SpecConfig(mode=args.speculative)))
    order = ["pdserve", "llama", "llama", "pdserve"] * args.rounds if peer else ["pdserve"] * (2 * args.rounds)
    turns = []
    for i, system in enumerate(order):
        print(f"turn {i + 1}/{len(order)}: {system}", file=sys.stderr, flush=True)
        t = pdserve_turn(engine, seed=i + 1) if system == "pdserve" else llama_turn(args.llama_bench, model_path, args.threads)
        turns.append({"system": system, **t})
    engine.pool.check_invariants()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"# pdserve engine vs llama.cpp, {model_path.name}, {args.threads} threads, {len(order)} turns "
          f"({' '.join(s[0].upper() for s in order)}); pdserve peak RSS {rss:.0f} MiB\n")
    print(report(turns))
    if args.json:
        Path(args.json).write_text(json.dumps({"turns": turns, "peak_rss_MiB": rss}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
