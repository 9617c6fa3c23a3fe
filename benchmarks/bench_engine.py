"""Engine-level benchmark on the real model: batching throughput, prefix-cache TTFT, and how long
prompts arriving disturb the inter-token latency of streams that are decoding (chunked prefill on/off).

    /tmp/venv0/bin/python benchmarks/bench_engine.py [--quick] [--dtype float32 --quantization none]
                                                     [--repeats N] [--out benchmarks/results/engine.md]

One process steps one `LLMEngine` in a loop (the offline engine). Requests "arrive" on a schedule:
each loop iteration adds every request whose arrival time has passed on the wall clock, then steps;
a token's arrival is `time.perf_counter()` right after the step that produced it. Every scenario
runs its variants interleaved (A B B A …) on engines sharing one loaded model, and the report quotes
medians over repeats, ratios taken within a repeat, and the spread. Progress goes to stderr; the
markdown report goes to stdout and to `--out` ("" to skip writing).

Default run ≈ 5–7 minutes on 2 cores; `--quick` ≈ 2 minutes (a smoke test: one repeat, short runs).
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import random
import shlex
import statistics
import sys
import time
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from shared.config import EngineConfig
from shared.engine.engine import LLMEngine, RequestOutput
from shared.model.hub import resolve_model_path
from shared.model.llama import LlamaModel, load_model
from shared.model.sampling import SamplingParams
from shared.model.tokenizer import Tokenizer

log = logging.getLogger("bench_engine")

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "engine.md"


# ------------------------------------------------------------------------------------ settings


@dataclass(frozen=True)
class Settings:
    """Workload sizes; `--quick` swaps in smaller ones."""

    repeats: int = 3
    # 1. batching throughput: closed loop, chat prompts of 100–300 tokens
    chat_output_tokens: int = 128
    high_concurrency: int = 16
    requests_at_1: int = 4
    requests_at_high: int = 32
    # 2. prefix cache TTFT
    prefix_tokens: int = 1800
    tail_tokens: int = 200
    # 3. interference
    interference_repeats: int = 2
    num_streams: int = 8
    stream_prompt_tokens: int = 200
    long_prompt_tokens: int = 2000
    long_output_tokens: int = 32  # the long-doc workload's low end (BENCH.md)
    window_s: float = 20.0
    long_interval_s: float = 4.0
    first_long_at_s: float = 1.0
    chunk_budgets: tuple[int, ...] = (512, 256)


QUICK = Settings(repeats=1, requests_at_1=2, requests_at_high=16, interference_repeats=1, window_s=10.0,
                 long_interval_s=3.0)


# ------------------------------------------------------------------------------------ workload

_SUBJECTS = ["the engineer", "a small team", "the old library", "our scheduler", "the river", "a curious student",
             "the city council", "every morning train", "the research group", "a tired traveller", "the museum",
             "the kitchen staff", "a quiet neighbour", "the weather service", "the orchestra", "a new startup"]
_VERBS = ["described", "measured", "rebuilt", "questioned", "ignored", "celebrated", "compared", "painted",
          "explained", "delayed", "recorded", "organised", "translated", "borrowed", "tested", "summarised"]
_OBJECTS = ["the annual budget", "a broken bridge", "three long letters", "the harvest festival", "an unusual map",
            "the memory bandwidth", "a forgotten recipe", "the quarterly report", "two stubborn cats",
            "the coastal road", "a box of photographs", "the night sky", "the evening news", "a garden plan"]
_TAILS = ["before the storm arrived", "with great patience", "for the third time this year", "without telling anyone",
          "while the rest of the town slept", "in a surprisingly short time", "after a long discussion",
          "because nobody else would", "under a grey and heavy sky", "to everyone's relief", "at the last minute"]
_OPENERS = ["Please read the following notes and answer briefly.", "Summarise this for a busy reader.",
            "What is the main point of the passage below?", "Explain what happened, step by step."]


def sentence(rng: random.Random) -> str:
    s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}"
    if rng.random() < 0.3:
        s += f", and {rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
    return s[0].upper() + s[1:] + ("?" if rng.random() < 0.1 else ".")


def make_prompt(tokenizer: Tokenizer, rng: random.Random, n_tokens: int, opener: bool = True) -> list[int]:
    """Exactly `n_tokens` tokens of seeded English-like text (sentences until long enough, then cut)."""
    parts = [rng.choice(_OPENERS)] if opener else []
    ids: list[int] = []
    while len(ids) < n_tokens:
        parts.extend(sentence(rng) for _ in range(max(4, (n_tokens - len(ids)) // 12)))
        ids = tokenizer.encode(" ".join(parts), add_special_tokens=False)
    return ids[:n_tokens]


def chat_prompts(tokenizer: Tokenizer, seed: int, count: int, lo: int = 100, hi: int = 300) -> list[list[int]]:
    rng = random.Random(seed)
    return [make_prompt(tokenizer, rng, rng.randint(lo, hi)) for _ in range(count)]


# ------------------------------------------------------------------------------------ engines


@dataclass
class EngineFactory:
    """One loaded model; a fresh engine (empty KV cache and prefix cache) per run."""

    model: LlamaModel
    tokenizer: Tokenizer
    model_id: str
    base: EngineConfig

    @classmethod
    def load(cls, base: EngineConfig) -> EngineFactory:
        path = resolve_model_path(base.model)
        model = load_model(path, dtype=base.torch_dtype, device=base.device, quantization=base.quantization)
        return cls(model, Tokenizer.from_gguf(path), Path(path).name, base)

    def make(self, **overrides) -> LLMEngine:
        return LLMEngine(self.model, self.tokenizer, replace(self.base, **overrides), model_id=self.model_id)

    def warm_up(self) -> None:
        """Pay torch's first-call costs (thread pool, kernel selection) before anything is timed."""
        engine = self.make(num_kv_blocks=256)
        traces: dict[str, Trace] = {}
        for i, n in enumerate((150, 700)):  # a one-step prefill, a chunked one, then decodes
            submit(engine, traces, f"warmup-{i}", make_prompt(self.tokenizer, random.Random(i), n), max_tokens=8)
        drain(engine, traces)


# ------------------------------------------------------------------------------------ measuring


@dataclass
class Trace:
    """One request as the client sees it: when it arrived, when each token came."""

    arrival: float
    num_prompt_tokens: int
    token_times: list[float] = field(default_factory=list)
    num_cached_tokens: int = 0
    finished: bool = False

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival

    def itls(self, start: float = float("-inf"), end: float = float("inf")) -> list[float]:
        """Gaps between consecutive tokens, for gaps that end inside [start, end]."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:]) if start <= b <= end]

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None


def submit(engine: LLMEngine, traces: dict[str, Trace], rid: str, prompt: list[int], max_tokens: int,
           arrival: float | None = None) -> Trace:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request(rid, prompt, params)
    traces[rid] = Trace(time.perf_counter() if arrival is None else arrival, len(prompt))
    return traces[rid]


def step_and_record(engine: LLMEngine, traces: dict[str, Trace]) -> list[RequestOutput]:
    """One engine step; every output's tokens are stamped with the time the step returned."""
    outs = engine.step()
    now = time.perf_counter()
    for out in outs:
        trace = traces[out.request_id]
        trace.token_times.extend([now] * len(out.new_token_ids))
        trace.num_cached_tokens = out.num_cached_tokens
        trace.finished = out.finished
    return outs


def drain(engine: LLMEngine, traces: dict[str, Trace]) -> None:
    while engine.has_unfinished():
        step_and_record(engine, traces)


def assert_no_leak(engine: LLMEngine) -> None:
    """After a run every request is gone: the pool is consistent and no block is still in use."""
    engine.pool.check_invariants()
    assert engine.pool.num_used_blocks == 0, f"{engine.pool.num_used_blocks} KV blocks still in use after the run"


def pct(xs: list[float], q: int) -> float:
    """q-th percentile (inclusive method); a single sample is its own percentile."""
    if len(xs) == 1:
        return xs[0]
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1]


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def interleaved(variants: list, repeat: int) -> list:
    """A B … on even repeats, … B A on odd ones, so drift over time hits every variant alike."""
    return variants if repeat % 2 == 0 else variants[::-1]


# ------------------------------------------------------------------------------- 1. throughput


@dataclass
class LoadRun:
    concurrency: int
    elapsed_s: float
    traces: list[Trace]
    preemptions: int

    @property
    def output_tokens(self) -> int:
        return sum(len(t.token_times) for t in self.traces)

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def total_tok_s(self) -> float:
        """Prompt + output tokens per second."""
        return (self.output_tokens + sum(t.num_prompt_tokens for t in self.traces)) / self.elapsed_s

    @property
    def req_s(self) -> float:
        return len(self.traces) / self.elapsed_s


def run_closed_loop(engine: LLMEngine, prompts: list[list[int]], concurrency: int, max_tokens: int) -> LoadRun:
    """Keep `concurrency` requests in flight until every prompt is done; a finished request's slot
    is refilled right after the step that finished it."""
    pending = deque(enumerate(prompts))
    traces: dict[str, Trace] = {}

    def admit() -> None:
        i, prompt = pending.popleft()
        submit(engine, traces, f"c{concurrency}-{i}", prompt, max_tokens)

    t0 = time.perf_counter()
    for _ in range(min(concurrency, len(prompts))):
        admit()
    while engine.has_unfinished():
        for out in step_and_record(engine, traces):
            if out.finished and pending:
                admit()
    elapsed = time.perf_counter() - t0
    assert_no_leak(engine)
    return LoadRun(concurrency, elapsed, list(traces.values()), engine.stats.preemptions)


def bench_throughput(factory: EngineFactory, s: Settings) -> dict[int, list[LoadRun]]:
    high = s.high_concurrency
    prompts = chat_prompts(factory.tokenizer, seed=1, count=max(s.requests_at_1, s.requests_at_high))
    plan = {1: prompts[: s.requests_at_1], high: prompts[: s.requests_at_high]}
    runs: dict[int, list[LoadRun]] = {1: [], high: []}
    for r in range(s.repeats):
        for c in interleaved([1, high], r):
            engine = factory.make(enable_chunked_prefill=True)
            run = run_closed_loop(engine, plan[c], c, s.chat_output_tokens)
            log.info("throughput  repeat %d  concurrency %2d: %.1f output tok/s", r, c, run.output_tok_s)
            runs[c].append(run)
    return runs


# ------------------------------------------------------------------------------ 2. prefix cache


@dataclass
class PrefixRun:
    warm: bool
    ttft_s: float
    cached_tokens: int


def time_first_token(engine: LLMEngine, rid: str, prompt: list[int]) -> Trace:
    """Run one prompt alone (max_tokens=1) and return its trace."""
    traces: dict[str, Trace] = {}
    trace = submit(engine, traces, rid, prompt, max_tokens=1)
    drain(engine, traces)
    return trace


def prefix_run(engine: LLMEngine, doc: list[int], tails: tuple[list[int], list[int]], warm: bool, tag: str) -> PrefixRun:
    """TTFT of doc + tails[1]: cold (prefix cache emptied) or warm (doc + tails[0] ran just before)."""
    engine.pool.reset_prefix_cache()
    if warm:
        time_first_token(engine, f"{tag}-prime", doc + tails[0])
    trace = time_first_token(engine, f"{tag}-measure", doc + tails[1])
    assert_no_leak(engine)
    return PrefixRun(warm, trace.ttft, trace.num_cached_tokens)


def bench_prefix_cache(factory: EngineFactory, s: Settings) -> list[PrefixRun]:
    engine = factory.make(enable_prefix_caching=True)
    runs = []
    for r in range(s.repeats):
        rng = random.Random(100 + r)
        doc = make_prompt(factory.tokenizer, rng, s.prefix_tokens)
        tails = (make_prompt(factory.tokenizer, rng, s.tail_tokens, opener=False),
                 make_prompt(factory.tokenizer, rng, s.tail_tokens, opener=False))
        for warm in interleaved([False, True], r):
            run = prefix_run(engine, doc, tails, warm, tag=f"p{r}-{'warm' if warm else 'cold'}")
            log.info("prefix      repeat %d  %s: TTFT %.0f ms (%d cached)", r, "warm" if warm else "cold",
                     run.ttft_s * 1e3, run.cached_tokens)
            runs.append(run)
    return runs


# ------------------------------------------------------------------------------ 3. interference


@dataclass(frozen=True)
class Variant:
    name: str
    with_long_prompts: bool
    chunked: bool
    budget: int  # max_num_batched_tokens asked for (chunking off raises it to the model length)


@dataclass
class InterferenceRun:
    variant: Variant
    itls: list[float]  # the streams' gaps inside the window, all streams pooled
    long_ttfts: list[float]
    steps_in_window: int
    streams_ended_early: int
    preemptions: int


def interference_variants(s: Settings) -> list[Variant]:
    chunked = [Variant(f"(b) chunked prefill, budget {b}", True, True, b) for b in s.chunk_budgets]
    return [Variant("(a) baseline: no long prompts", False, True, 512), *chunked,
            Variant("(c) chunked prefill OFF", True, False, 512)]


def start_streams(engine: LLMEngine, traces: dict[str, Trace], prompts: list[list[int]]) -> list[Trace]:
    """Add the chat streams and step until every one has its first token (not measured)."""
    max_tokens = engine.max_model_len - max(len(p) for p in prompts) - 1  # aborted at the window's end
    streams = [submit(engine, traces, f"stream-{i}", p, max_tokens) for i, p in enumerate(prompts)]
    while not all(t.token_times for t in streams):
        step_and_record(engine, traces)
    return streams


def run_window(engine: LLMEngine, traces: dict[str, Trace], arrivals: deque[tuple[float, list[int]]],
               long_output_tokens: int, end: float) -> tuple[list[Trace], int]:
    """Step until `end`, adding each long prompt once its arrival time has passed. TTFT counts from
    the scheduled arrival, so time spent waiting for the step in progress is part of it."""
    long_traces, steps = [], 0
    while time.perf_counter() < end:
        while arrivals and arrivals[0][0] <= time.perf_counter():
            at, prompt = arrivals.popleft()
            long_traces.append(submit(engine, traces, f"long-{len(long_traces)}", prompt, long_output_tokens, at))
        step_and_record(engine, traces)
        steps += 1
    return long_traces, steps


def finish_long_prompts(engine: LLMEngine, traces: dict[str, Trace], long_traces: list[Trace]) -> None:
    """After the window: keep stepping until every long prompt that arrived has its first token."""
    while not all(t.token_times for t in long_traces):
        step_and_record(engine, traces)


def abort_all(engine: LLMEngine, traces: dict[str, Trace]) -> None:
    for rid, trace in traces.items():
        if not trace.finished:
            engine.abort(rid)


def run_interference(engine: LLMEngine, v: Variant, stream_prompts: list[list[int]],
                     long_prompts: list[list[int]], s: Settings) -> InterferenceRun:
    traces: dict[str, Trace] = {}
    streams = start_streams(engine, traces, stream_prompts)
    start = time.perf_counter()
    end = start + s.window_s
    schedule = [start + s.first_long_at_s + k * s.long_interval_s for k in range(len(long_prompts))]
    arrivals = deque((at, p) for at, p in zip(schedule, long_prompts) if at < end) if v.with_long_prompts else deque()
    long_traces, steps = run_window(engine, traces, arrivals, s.long_output_tokens, end)
    itls = [gap for t in streams for gap in t.itls(start, end)]
    finish_long_prompts(engine, traces, long_traces)
    ended_early = sum(t.finished for t in streams)
    abort_all(engine, traces)
    assert_no_leak(engine)
    return InterferenceRun(v, itls, [t.ttft for t in long_traces], steps, ended_early, engine.stats.preemptions)


def bench_interference(factory: EngineFactory, s: Settings) -> list[InterferenceRun]:
    tok = factory.tokenizer
    variants = interference_variants(s)
    n_long = int(s.window_s // s.long_interval_s) + 1
    runs = []
    for r in range(s.interference_repeats):
        rng = random.Random(200 + r)  # fresh prompts each repeat; each variant sees the same ones
        streams = [make_prompt(tok, rng, s.stream_prompt_tokens + rng.randint(-10, 10)) for _ in range(s.num_streams)]
        longs = [make_prompt(tok, rng, s.long_prompt_tokens) for _ in range(n_long)]
        for v in interleaved(variants, r):
            engine = factory.make(enable_chunked_prefill=v.chunked, max_num_batched_tokens=v.budget)
            run = run_interference(engine, v, streams, longs, s)
            log.info("interference repeat %d  %-32s ITL p99 %.0f ms, %d long prompts", r, v.name,
                     pct(run.itls, 99) * 1e3, len(run.long_ttfts))
            runs.append(run)
    return runs


# ------------------------------------------------------------------------------------ report


def ms(x: float) -> str:
    return f"{x * 1e3:.0f}"


def spread(xs: list[float]) -> str:
    """min–max as ± percent of the median: how noisy the repeats were."""
    m = median(xs)
    return f"±{50 * (max(xs) - min(xs)) / m:.0f}%" if len(xs) > 1 and m else "n/a (1 run)"


def verdict(value: float, target: float) -> str:
    return f"**meets** the ≥ {target:g}× target" if value >= target else f"**misses** the ≥ {target:g}× target"


def report_header(args: argparse.Namespace, factory: EngineFactory, s: Settings, load: tuple, total_s: float) -> list[str]:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    quant = factory.base.quantization or "none"
    return [
        "# pdserve engine benchmark (offline engine, one process)",
        "",
        f"Command: `{shlex.join([sys.executable, *sys.argv])}`",
        "",
        f"- model: `{factory.model_id}`; weights {factory.base.dtype} + quantization {quant}; "
        f"KV cache {factory.base.dtype}, {factory.base.num_kv_blocks} blocks of {factory.base.block_size} tokens",
        f"- machine: {os.cpu_count()} CPUs ({cpu}); torch {torch.__version__}, **{torch.get_num_threads()} threads**",
        f"- load average (1 min) at start {load[0]:.2f}, at end {load[1]:.2f} (the machine is shared)",
        f"- total run time: **{total_s:.0f} s**{' (--quick)' if args.quick else ''}; "
        f"repeats: {s.repeats} (throughput, prefix), {s.interference_repeats} (interference), interleaved A B B A",
        "",
    ]


def report_throughput(runs: dict[int, list[LoadRun]], s: Settings) -> list[str]:
    lines = [
        f"## 1. Batching throughput (chat: prompts 100–300 tokens, {s.chat_output_tokens} output tokens, "
        "ignore_eos, closed loop)",
        "",
        "| concurrency | requests | output tok/s (median) | noise | total tok/s | req/s | TTFT p50 ms | TPOT p50 ms "
        "| ITL p99 ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c, rs in runs.items():
        traces = [t for r in rs for t in r.traces]
        tpots = [t.tpot for t in traces if t.tpot is not None]
        itls = [g for t in traces for g in t.itls()]
        tok_s = [r.output_tok_s for r in rs]
        lines.append(f"| {c} | {len(rs[0].traces)} | **{median(tok_s):.1f}** | {spread(tok_s)} | "
                     f"{median([r.total_tok_s for r in rs]):.0f} | {median([r.req_s for r in rs]):.2f} | {ms(pct([t.ttft for t in traces], 50))} | "
                     f"{ms(pct(tpots, 50))} | {ms(pct(itls, 99))} |")
    low, high = runs[1], runs[s.high_concurrency]
    ratios = [h.output_tok_s / lo.output_tok_s for lo, h in zip(low, high)]
    per = ", ".join(f"{x:.2f}" for x in ratios)
    lines += ["", f"Throughput ratio concurrency {s.high_concurrency} / 1: **{median(ratios):.2f}×** "
              f"(per repeat: {per}) — {verdict(median(ratios), 4)}. "
              f"Preemptions: {sum(r.preemptions for rs in runs.values() for r in rs)}.", ""]
    return lines


def report_prefix(runs: list[PrefixRun], s: Settings) -> list[str]:
    cold = [r for r in runs if not r.warm]
    warm = [r for r in runs if r.warm]
    total = s.prefix_tokens + s.tail_tokens
    lines = [
        f"## 2. Prefix cache TTFT ({total}-token prompt, first {s.prefix_tokens} tokens shared with a request "
        "run just before)",
        "",
        "| prompt | cached tokens | TTFT median ms | noise | per repeat ms |",
        "|---|---|---|---|---|",
    ]
    for name, rs in (("cold (prefix cache reset)", cold), ("warm (prefix cached)", warm)):
        ttfts = [r.ttft_s for r in rs]
        lines.append(f"| {name} | {rs[0].cached_tokens} | **{ms(median(ttfts))}** | {spread(ttfts)} | "
                     f"{', '.join(ms(x) for x in ttfts)} |")
    ratios = [c.ttft_s / w.ttft_s for c, w in zip(cold, warm)]
    lines += ["", f"TTFT cold / warm: **{median(ratios):.1f}×** (per repeat: "
              f"{', '.join(f'{x:.1f}' for x in ratios)}) — {verdict(median(ratios), 5)}.", ""]
    return lines


def report_interference(runs: list[InterferenceRun], s: Settings) -> list[str]:
    variants = list(dict.fromkeys(r.variant for r in runs))
    by_variant = {v: [r for r in runs if r.variant == v] for v in variants}
    baseline = by_variant[variants[0]]
    lines = [
        f"## 3. Interference ({s.num_streams} chat streams decoding, prompts ~{s.stream_prompt_tokens} tokens; "
        f"{s.long_prompt_tokens}-token prompts ({s.long_output_tokens} output tokens) arriving every "
        f"{s.long_interval_s:g} s from t = {s.first_long_at_s:g} s of a {s.window_s:g} s window)",
        "",
        "ITL of the chat streams inside the window, all streams pooled; percentiles are medians over "
        f"{s.interference_repeats} repeat(s); max is the worst over repeats; the p99 ratio is taken within each "
        "repeat against that repeat's baseline, then the median.",
        "",
        "| variant | ITL p50 ms | p90 ms | p99 ms | max ms | p99 / baseline p99 | long TTFT p50 ms | long TTFT max ms "
        "| long prompts | ITL samples |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for v, rs in by_variant.items():
        lines.append(interference_row(v, rs, baseline))
    notes = []
    early = sum(r.streams_ended_early for r in runs)
    if early:
        notes.append(f"{early} stream(s) hit max_tokens inside the window: the window is too long for the context.")
    notes.append(f"Preemptions: {sum(r.preemptions for r in runs)}. Chunking off runs a whole prompt in one step "
                 "(the engine raises the step budget to the model length).")
    return lines + ["", *notes, ""]


def interference_row(v: Variant, rs: list[InterferenceRun], baseline: list[InterferenceRun]) -> str:
    p = {q: median([pct(r.itls, q) for r in rs]) for q in (50, 90, 99)}
    worst = max(max(r.itls) for r in rs)
    ratios = [pct(r.itls, 99) / pct(b.itls, 99) for r, b in zip(rs, baseline)]
    ttfts = [t for r in rs for t in r.long_ttfts]
    long_cols = f"{ms(median(ttfts))} | {ms(max(ttfts))}" if ttfts else "– | –"
    return (f"| {v.name} | {ms(p[50])} | {ms(p[90])} | **{ms(p[99])}** | {ms(worst)} | "
            f"{median(ratios):.1f}× | {long_cols} | {len(ttfts)} | {sum(len(r.itls) for r in rs)} |")


# ------------------------------------------------------------------------------------ main


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file or HF directory (default: the cached default model)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default="int8", help="int8 | none")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--num-kv-blocks", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=None, help="repeats of scenarios 1 and 2 (default 3, quick 1)")
    ap.add_argument("--quick", action="store_true", help="a ~2-minute smoke run")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help='where to write the report ("" = only stdout)')
    return ap.parse_args()


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    args = parse_args()
    s = QUICK if args.quick else Settings()
    if args.repeats:
        s = replace(s, repeats=args.repeats)
    if args.threads:
        torch.set_num_threads(args.threads)
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    base = EngineConfig(model=args.model, dtype=args.dtype, quantization=None if args.quantization == "none" else args.quantization,
                        num_kv_blocks=args.num_kv_blocks, max_num_seqs=64, max_num_batched_tokens=512,
                        enable_chunked_prefill=True, enable_prefix_caching=True)
    factory = EngineFactory.load(base)
    factory.warm_up()
    throughput = bench_throughput(factory, s)
    prefix = bench_prefix_cache(factory, s)
    interference = bench_interference(factory, s)
    total = time.perf_counter() - t0
    lines = [*report_header(args, factory, s, (load0, os.getloadavg()[0]), total),
             *report_throughput(throughput, s), *report_prefix(prefix, s), *report_interference(interference, s)]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
