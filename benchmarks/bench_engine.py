"""Engine-level benchmark on the real model: batching throughput, prefix-cache TTFT, and how long
prompts arriving disturb the inter-token latency (ITL) of streams that are decoding (chunked prefill
on / off).

    .venv/bin/python benchmarks/bench_engine.py [--quick] [--dtype float32 --quantization none]
                                                     [--threads N] [--out benchmarks/results/engine.md]

One process steps one `LLMEngine` in a loop (the offline engine). Requests "arrive" on a schedule:
each loop iteration adds every request whose arrival time has passed on the wall clock, then steps;
a token's arrival is `time.perf_counter()` right after the step that produced it. Every scenario
runs its variants interleaved (A B B A …) on fresh engines sharing one loaded model; the report
quotes medians over repeats, ratios taken within a repeat, and the spread.

The machine is shared, and with torch using both cores a neighbour holding one core makes a step
10–40× slower. So between steps (every ≥ 0.25 s, as /proc/stat counts in 10 ms ticks) the benchmark
reads /proc/stat to see how much CPU other processes took meanwhile; a step during which they held
≥ 0.5 core is *contended*. A run that spent more than 20% of its step time contended is
discarded and run again (at most 3 times per scenario, and only in the first 5 minutes, to bound
the run time); the report lists the discarded runs and shows every kept run's contention.

Progress goes to stderr; the markdown report goes to stdout and to `--out` ("" to skip writing).
Default run ≈ 6 minutes on 2 cores; `--quick` ≈ 2 minutes (a smoke test: one repeat, short runs).
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
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Protocol, TypeVar

import torch

from shared.config import EngineConfig
from shared.engine.engine import LLMEngine, RequestOutput
from shared.model.hub import resolve_model_path
from shared.model.llama import LlamaModel, load_model
from shared.model.sampling_params import SamplingParams
from shared.model.tokenizer import Tokenizer

log = logging.getLogger("bench_engine")

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "engine.md"
CONTENDED_CORES = 0.5  # a step during which other processes held this much CPU is "contended"
MAX_CONTENDED_SHARE = 0.2  # a run with more of its step time contended than this is run again
SEGMENT_S = 0.25  # /proc/stat counts 10 ms ticks: contention is judged over runs of steps this long


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
    # 3. interference. A 2000-token prefill takes ~2.8 s on 2 cores, so one every 4 s keeps the
    #    cores ~70% busy with prefill; one every 3 s would saturate them and TTFT would only grow.
    interference_repeats: int = 3
    num_streams: int = 8
    stream_prompt_tokens: int = 200
    long_prompt_tokens: int = 2000
    long_output_tokens: int = 32  # the long-doc workload's low end (BENCH.md)
    window_s: float = 16.0
    long_interval_s: float = 4.0
    first_long_at_s: float = 1.0
    chunk_budgets: tuple[int, ...] = (512, 256)
    retries: int = 3  # contended runs each scenario may discard and run again …
    retry_until_s: float = 300.0  # … while the benchmark has run less than this


QUICK = Settings(repeats=1, requests_at_1=2, requests_at_high=16, interference_repeats=1, window_s=9.0, retries=1,
                 retry_until_s=75.0)


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


# ------------------------------------------------------------------------------------ measuring


@dataclass(frozen=True)
class CpuSnapshot:
    """Machine-wide busy CPU time (/proc/stat, hypervisor steal included) and this process's own."""

    wall: float
    machine_busy_s: float
    own_cpu_s: float

    @classmethod
    def take(cls) -> CpuSnapshot:
        # cpu  user nice system idle iowait irq softirq steal …   (in clock ticks)
        ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        busy = sum(ticks) - ticks[3] - ticks[4]
        return cls(time.perf_counter(), busy / os.sysconf("SC_CLK_TCK"), time.process_time())

    def others_cores_since(self, earlier: CpuSnapshot) -> float:
        """Average number of cores other processes (or the hypervisor) kept busy in between."""
        others = (self.machine_busy_s - earlier.machine_busy_s) - (self.own_cpu_s - earlier.own_cpu_s)
        return max(0.0, others / (self.wall - earlier.wall))


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
        """Gaps between consecutive tokens that start inside [start, end): a step still running at
        `end` counts (the caller steps on past it)."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:]) if start <= a < end]

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None


@dataclass
class StepStats:
    """Where the engine's time went. A step "carries prefill" when it computed more tokens than it
    returned outputs (a decode row computes one token and returns one)."""

    steps: int = 0
    step_s: float = 0.0
    prefill_step_s: float = 0.0
    contended_step_s: float = 0.0
    clean_decode_tokens: int = 0  # outputs of uncontended steps without prefill
    clean_decode_s: float = 0.0
    longest_step_s: float = 0.0
    others_cpu_s: float = 0.0  # core-seconds other processes used during the steps

    def add(self, seconds: float, tokens_computed: int, num_outputs: int, others_cores: float) -> None:
        self.steps += 1
        self.step_s += seconds
        self.longest_step_s = max(self.longest_step_s, seconds)
        self.others_cpu_s += others_cores * seconds
        has_prefill = tokens_computed > num_outputs
        contended = others_cores >= CONTENDED_CORES
        self.prefill_step_s += seconds if has_prefill else 0.0
        self.contended_step_s += seconds if contended else 0.0
        if not has_prefill and not contended:
            self.clean_decode_tokens += num_outputs
            self.clean_decode_s += seconds

    @property
    def prefill_share(self) -> float:
        return self.prefill_step_s / self.step_s if self.step_s else 0.0

    @property
    def contended_share(self) -> float:
        return self.contended_step_s / self.step_s if self.step_s else 0.0

    @property
    def others_cores(self) -> float:
        return self.others_cpu_s / self.step_s if self.step_s else 0.0

    @property
    def clean_decode_tok_s(self) -> float:
        """Output tokens/s of uncontended steps that only decoded: what batching alone buys."""
        return self.clean_decode_tokens / self.clean_decode_s if self.clean_decode_s else float("nan")


class Recorder:
    """The client side of one run: submits requests, steps the engine, stamps every token, and
    accounts each step's time (`stats()`)."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.traces: dict[str, Trace] = {}
        self._stats = StepStats()
        self._segment: list[tuple[float, int, int]] = []  # (seconds, tokens computed, outputs) per step
        self._segment_start = CpuSnapshot.take()

    def submit(self, rid: str, prompt: list[int], max_tokens: int, arrival: float | None = None) -> Trace:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.engine.add_request(rid, prompt, params)
        self.traces[rid] = Trace(time.perf_counter() if arrival is None else arrival, len(prompt))
        return self.traces[rid]

    def step(self) -> list[RequestOutput]:
        """One engine step; every output's tokens are stamped with the time the step returned."""
        computed_before = self.engine.stats.tokens_computed
        t0 = time.perf_counter()
        outs = self.engine.step()
        now = time.perf_counter()
        self._segment.append((now - t0, self.engine.stats.tokens_computed - computed_before, len(outs)))
        if now - self._segment_start.wall >= SEGMENT_S:
            self._close_segment()
        for out in outs:
            trace = self.traces[out.request_id]
            trace.token_times.extend([now] * len(out.new_token_ids))
            trace.num_cached_tokens = out.num_cached_tokens
            trace.finished = out.finished
        return outs

    def _close_segment(self) -> None:
        """Account the steps since the last snapshot, all with the segment's contention."""
        snap = CpuSnapshot.take()
        others = snap.others_cores_since(self._segment_start)
        for seconds, computed, outputs in self._segment:
            self._stats.add(seconds, computed, outputs, others)
        self._segment, self._segment_start = [], snap

    def stats(self) -> StepStats:
        """The steps so far (a copy)."""
        self._close_segment()
        return replace(self._stats)

    def reset_stats(self) -> None:
        self._close_segment()
        self._stats = StepStats()

    def drain(self) -> None:
        while self.engine.has_unfinished():
            self.step()

    def abort_unfinished(self) -> None:
        for rid, trace in self.traces.items():
            if not trace.finished:
                self.engine.abort(rid)


def assert_no_leak(engine: LLMEngine) -> None:
    """After a run every request is gone: the pool is consistent and no block is still in use."""
    engine.pool.check_invariants()
    assert engine.pool.num_used_blocks == 0, f"{engine.pool.num_used_blocks} KV blocks still in use after the run"


def pct(xs: list[float], q: int) -> float:
    """q-th percentile (inclusive method); nan for no samples."""
    if len(xs) < 2:
        return xs[0] if xs else float("nan")
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1]


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def interleaved(variants: list, repeat: int) -> list:
    """A B … on even repeats, … B A on odd ones, so drift over time hits every variant alike."""
    return variants if repeat % 2 == 0 else variants[::-1]


class HasSteps(Protocol):
    steps: StepStats


R = TypeVar("R", bound=HasSteps)


@dataclass
class Retries:
    """How many contended runs a scenario may still throw away (and until when), and the ones it did."""

    left: int
    deadline: float  # perf_counter time after which no run is repeated, to bound the total run time
    discarded: list[str] = field(default_factory=list)

    def run(self, label: str, measure: Callable[[], R]) -> R:
        """`measure()` again while its run was mostly contended and retries and time are left."""
        while True:
            result = measure()
            share = result.steps.contended_share
            if share <= MAX_CONTENDED_SHARE or self.left == 0 or time.perf_counter() > self.deadline:
                return result
            self.left -= 1
            self.discarded.append(f"{label} ({100 * share:.0f}% contended)")
            log.info("discarded %s: %.0f%% of its step time contended; running it again", label, 100 * share)
            wait_for_quiet()


def wait_for_quiet(max_wait_s: float = 20.0, probe_s: float = 2.0) -> None:
    """Give a busy neighbour a chance to finish: return once other processes kept less than half the
    contention threshold busy over `probe_s`, or after `max_wait_s`."""
    deadline = time.perf_counter() + max_wait_s
    while time.perf_counter() < deadline:
        before = CpuSnapshot.take()
        time.sleep(probe_s)  # a polling interval: there is no event to wait on for "the machine got quiet"
        if CpuSnapshot.take().others_cores_since(before) < CONTENDED_CORES / 2:
            return


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
        path = Path(resolve_model_path(base.model))
        model = load_model(path, dtype=base.torch_dtype, device=base.device, quantization=base.quantization)
        tokenizer = Tokenizer.from_gguf(path) if path.is_file() else Tokenizer.from_hf_dir(path)
        return cls(model, tokenizer, path.name, base)

    def make(self, **overrides) -> LLMEngine:
        return LLMEngine(self.model, self.tokenizer, replace(self.base, **overrides), model_id=self.model_id)

    def warm_up(self) -> None:
        """Pay torch's first-call costs (thread pool, kernel selection) before anything is timed."""
        rec = Recorder(self.make(num_kv_blocks=256))
        for i, n in enumerate((150, 700)):  # a one-step prefill, a chunked one, then decodes
            rec.submit(f"warmup-{i}", make_prompt(self.tokenizer, random.Random(i), n), max_tokens=8)
        rec.drain()


# ------------------------------------------------------------------------------- 1. throughput


@dataclass
class LoadRun:
    concurrency: int
    elapsed_s: float
    traces: list[Trace]
    steps: StepStats
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


def run_closed_loop(engine: LLMEngine, prompts: list[list[int]], concurrency: int, max_tokens: int) -> LoadRun:
    """Keep `concurrency` requests in flight until every prompt is done; a finished request's slot
    is refilled right after the step that finished it."""
    pending = deque(enumerate(prompts))
    rec = Recorder(engine)

    def admit() -> None:
        i, prompt = pending.popleft()
        rec.submit(f"c{concurrency}-{i}", prompt, max_tokens)

    t0 = time.perf_counter()
    for _ in range(min(concurrency, len(prompts))):
        admit()
    while engine.has_unfinished():
        for out in rec.step():
            if out.finished and pending:
                admit()
    elapsed = time.perf_counter() - t0
    assert_no_leak(engine)
    return LoadRun(concurrency, elapsed, list(rec.traces.values()), rec.stats(), engine.stats.preemptions)


def closed_loop_on_fresh_engine(factory: EngineFactory, prompts: list[list[int]], concurrency: int,
                                max_tokens: int) -> LoadRun:
    return run_closed_loop(factory.make(), prompts, concurrency, max_tokens)


def bench_throughput(factory: EngineFactory, s: Settings, retries: Retries) -> dict[int, list[LoadRun]]:
    high = s.high_concurrency
    prompts = chat_prompts(factory.tokenizer, seed=1, count=max(s.requests_at_1, s.requests_at_high))
    plan = {1: prompts[: s.requests_at_1], high: prompts[: s.requests_at_high]}
    runs: dict[int, list[LoadRun]] = {1: [], high: []}
    for r in range(s.repeats):
        for c in interleaved([1, high], r):
            run = retries.run(f"concurrency {c}, repeat {r}",
                              partial(closed_loop_on_fresh_engine, factory, plan[c], c, s.chat_output_tokens))
            log.info("throughput   repeat %d  concurrency %2d: %.1f output tok/s (contended %.0f%%)",
                     r, c, run.output_tok_s, 100 * run.steps.contended_share)
            runs[c].append(run)
    return runs


# ------------------------------------------------------------------------------ 2. prefix cache


@dataclass
class PrefixRun:
    warm: bool
    ttft_s: float
    cached_tokens: int
    steps: StepStats


def first_token(engine: LLMEngine, rid: str, prompt: list[int]) -> tuple[Trace, StepStats]:
    """Run one prompt alone (max_tokens=1)."""
    rec = Recorder(engine)
    trace = rec.submit(rid, prompt, max_tokens=1)
    rec.drain()
    return trace, rec.stats()


def prefix_run(engine: LLMEngine, doc: list[int], tails: tuple[list[int], list[int]], warm: bool,
               tag: str) -> PrefixRun:
    """TTFT of doc + tails[1]: cold (prefix cache emptied) or warm (doc + tails[0] ran just before)."""
    engine.pool.reset_prefix_cache()
    if warm:
        first_token(engine, f"{tag}-prime", doc + tails[0])
    trace, steps = first_token(engine, f"{tag}-measure", doc + tails[1])
    assert_no_leak(engine)
    return PrefixRun(warm, trace.ttft, trace.num_cached_tokens, steps)


def bench_prefix_cache(factory: EngineFactory, s: Settings, retries: Retries) -> list[PrefixRun]:
    engine = factory.make()
    runs = []
    for r in range(s.repeats):
        rng = random.Random(100 + r)
        doc = make_prompt(factory.tokenizer, rng, s.prefix_tokens)
        tails = (make_prompt(factory.tokenizer, rng, s.tail_tokens, opener=False),
                 make_prompt(factory.tokenizer, rng, s.tail_tokens, opener=False))
        for warm in interleaved([False, True], r):
            tag = f"p{r}-{'warm' if warm else 'cold'}"
            run = retries.run(f"{'warm' if warm else 'cold'}, repeat {r}",
                              partial(prefix_run, engine, doc, tails, warm, tag))
            log.info("prefix       repeat %d  %s: TTFT %.0f ms (%d cached; contended %.0f%%)", r,
                     "warm" if warm else "cold", run.ttft_s * 1e3, run.cached_tokens, 100 * run.steps.contended_share)
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
    steps: StepStats  # the window only
    streams_ended_early: int
    preemptions: int


def interference_variants(s: Settings) -> list[Variant]:
    chunked = [Variant(f"(b) chunked prefill, budget {b}", True, True, b) for b in s.chunk_budgets]
    return [Variant("(a) baseline: no long prompts", False, True, max(s.chunk_budgets)), *chunked,
            Variant("(c) chunked prefill OFF", True, False, max(s.chunk_budgets))]


def start_streams(rec: Recorder, prompts: list[list[int]]) -> list[Trace]:
    """Add the chat streams and step until every one has its first token (not measured)."""
    max_tokens = rec.engine.max_model_len - max(len(p) for p in prompts) - 1  # aborted after the window
    streams = [rec.submit(f"stream-{i}", p, max_tokens) for i, p in enumerate(prompts)]
    while not all(t.token_times for t in streams):
        rec.step()
    return streams


def run_window(rec: Recorder, arrivals: deque[tuple[float, list[int]]], long_output_tokens: int,
               end: float) -> list[Trace]:
    """Step until `end`, adding each long prompt once its arrival time has passed. TTFT counts from
    the scheduled arrival, so time spent waiting for the step in progress is part of it."""
    long_traces: list[Trace] = []
    while time.perf_counter() < end:
        while arrivals and arrivals[0][0] <= time.perf_counter():
            at, prompt = arrivals.popleft()
            long_traces.append(rec.submit(f"long-{len(long_traces)}", prompt, long_output_tokens, at))
        rec.step()
    return long_traces


def run_interference(engine: LLMEngine, v: Variant, stream_prompts: list[list[int]],
                     long_prompts: list[list[int]], s: Settings) -> InterferenceRun:
    rec = Recorder(engine)
    streams = start_streams(rec, stream_prompts)
    rec.reset_stats()  # count the window only
    start = time.perf_counter()
    end = start + s.window_s
    schedule = [start + s.first_long_at_s + k * s.long_interval_s for k in range(len(long_prompts))]
    arrivals = deque((at, p) for at, p in zip(schedule, long_prompts) if at < end) if v.with_long_prompts else deque()
    long_traces = run_window(rec, arrivals, s.long_output_tokens, end)
    window_steps = rec.stats()
    itls = [gap for t in streams for gap in t.itls(start, end)]
    while not all(t.token_times for t in long_traces):  # every long prompt that arrived gets its TTFT
        rec.step()
    ended_early = sum(t.finished for t in streams)
    rec.abort_unfinished()
    assert_no_leak(engine)
    return InterferenceRun(v, itls, [t.ttft for t in long_traces], window_steps, ended_early,
                           engine.stats.preemptions)


def interference_on_fresh_engine(factory: EngineFactory, v: Variant, stream_prompts: list[list[int]],
                                 long_prompts: list[list[int]], s: Settings) -> InterferenceRun:
    engine = factory.make(enable_chunked_prefill=v.chunked, max_num_batched_tokens=v.budget)
    return run_interference(engine, v, stream_prompts, long_prompts, s)


def bench_interference(factory: EngineFactory, s: Settings, retries: Retries) -> list[InterferenceRun]:
    tok = factory.tokenizer
    variants = interference_variants(s)
    n_long = int(s.window_s // s.long_interval_s) + 1
    runs = []
    for r in range(s.interference_repeats):
        rng = random.Random(200 + r)  # fresh prompts each repeat; each variant sees the same ones
        streams = [make_prompt(tok, rng, s.stream_prompt_tokens + rng.randint(-10, 10)) for _ in range(s.num_streams)]
        longs = [make_prompt(tok, rng, s.long_prompt_tokens) for _ in range(n_long)]
        for v in interleaved(variants, r):
            run = retries.run(f"{v.name}, repeat {r}",
                              partial(interference_on_fresh_engine, factory, v, streams, longs, s))
            log.info("interference repeat %d  %-32s ITL p99 %.0f ms, longest step %.0f ms, %d long prompts "
                     "(contended %.0f%%)", r, v.name, pct(run.itls, 99) * 1e3, run.steps.longest_step_s * 1e3,
                     len(run.long_ttfts), 100 * run.steps.contended_share)
            runs.append(run)
    return runs


# ------------------------------------------------------------------------------------ report


def ms(x: float) -> str:
    return f"{x * 1e3:.0f}"


def spread(xs: list[float]) -> str:
    """(max − min) / 2 as a percent of the median: how far the repeats scattered."""
    m = median(xs)
    return f"±{50 * (max(xs) - min(xs)) / m:.0f}%" if len(xs) > 1 and m else "n/a (1 run)"


def contention(stats: list[StepStats]) -> str:
    """Per run: % of step time contended, and the cores other processes used on average."""
    return ", ".join(f"{100 * st.contended_share:.0f}% ({st.others_cores:.2f})" for st in stats)


def verdict(value: float, target: float) -> str:
    return f"**meets** the ≥ {target:g}× target" if value >= target else f"**misses** the ≥ {target:g}× target"


def report_header(args: argparse.Namespace, factory: EngineFactory, s: Settings, load: tuple[float, float],
                  total_s: float) -> list[str]:
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
        f"- total run time: **{total_s:.0f} s**{' (--quick)' if args.quick else ''}; "
        f"repeats: {s.repeats} (throughput, prefix), {s.interference_repeats} (interference), interleaved A B B A",
        f"- the machine is shared: load average (1 min) {load[0]:.2f} at start, {load[1]:.2f} at end. "
        f"\"Contended\" = share of step time in steps during which other processes held ≥ {CONTENDED_CORES} core "
        "(/proc/stat minus this process, hypervisor steal included); in brackets the cores they used on average, "
        "one entry per run",
        "",
    ]


def discarded_note(retries: Retries) -> list[str]:
    if not retries.discarded:
        return ["No run was discarded for contention.", ""]
    return [f"Discarded for contention and run again: {'; '.join(retries.discarded)}.", ""]


def report_throughput(runs: dict[int, list[LoadRun]], retries: Retries, s: Settings) -> list[str]:
    lines = [
        f"## 1. Batching throughput (chat: prompts 100–300 tokens, {s.chat_output_tokens} output tokens, "
        "ignore_eos, closed loop)",
        "",
        "| concurrency | requests | output tok/s (median) | noise | total tok/s | TTFT p50 ms | TPOT p50 ms "
        "| ITL p99 ms | time in steps with prefill | decode-only steps, tok/s | contended |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [throughput_row(c, rs) for c, rs in runs.items()]
    low, high = runs[1], runs[s.high_concurrency]
    ratios = [h.output_tok_s / lo.output_tok_s for lo, h in zip(low, high)]
    decode_ratio = (median([h.steps.clean_decode_tok_s for h in high])
                    / median([lo.steps.clean_decode_tok_s for lo in low]))
    lines += ["", f"Output throughput, concurrency {s.high_concurrency} / 1: **{median(ratios):.2f}×** (per repeat: "
              f"{', '.join(f'{x:.2f}' for x in ratios)}) — {verdict(median(ratios), 4)}. Counting only uncontended "
              f"steps that carry no prompt tokens, batching gives {decode_ratio:.1f}×. "
              f"Preemptions: {sum(r.preemptions for rs in runs.values() for r in rs)}.", ""]
    return lines + discarded_note(retries)


def throughput_row(c: int, rs: list[LoadRun]) -> str:
    traces = [t for r in rs for t in r.traces]
    tpots = [t.tpot for t in traces if t.tpot is not None]
    itls = [g for t in traces for g in t.itls()]
    tok_s = [r.output_tok_s for r in rs]
    return (f"| {c} | {len(rs[0].traces)} | **{median(tok_s):.1f}** | {spread(tok_s)} | "
            f"{median([r.total_tok_s for r in rs]):.0f} | {ms(pct([t.ttft for t in traces], 50))} | "
            f"{ms(pct(tpots, 50))} | {ms(pct(itls, 99))} | {100 * median([r.steps.prefill_share for r in rs]):.0f}% | "
            f"{median([r.steps.clean_decode_tok_s for r in rs]):.0f} | {contention([r.steps for r in rs])} |")


def report_prefix(runs: list[PrefixRun], retries: Retries, s: Settings) -> list[str]:
    cold = [r for r in runs if not r.warm]
    warm = [r for r in runs if r.warm]
    total = s.prefix_tokens + s.tail_tokens
    lines = [
        f"## 2. Prefix cache TTFT ({total}-token prompt, first {s.prefix_tokens} tokens shared with a request "
        "run just before)",
        "",
        "| prompt | cached tokens | TTFT median ms | noise | per repeat ms | contended |",
        "|---|---|---|---|---|---|",
    ]
    for name, rs in (("cold (prefix cache reset)", cold), ("warm (prefix cached)", warm)):
        ttfts = [r.ttft_s for r in rs]
        lines.append(f"| {name} | {rs[0].cached_tokens} | **{ms(median(ttfts))}** | {spread(ttfts)} | "
                     f"{', '.join(ms(x) for x in ttfts)} | {contention([r.steps for r in rs])} |")
    ratios = [c.ttft_s / w.ttft_s for c, w in zip(cold, warm)]
    lines += ["", f"TTFT cold / warm: **{median(ratios):.1f}×** (per repeat: "
              f"{', '.join(f'{x:.1f}' for x in ratios)}) — {verdict(median(ratios), 5)}.", ""]
    return lines + discarded_note(retries)


def report_interference(runs: list[InterferenceRun], retries: Retries, s: Settings) -> list[str]:
    variants = list(dict.fromkeys(r.variant for r in runs))
    by_variant = {v: [r for r in runs if r.variant == v] for v in variants}
    baseline = by_variant[variants[0]]
    lines = [
        f"## 3. Interference ({s.num_streams} chat streams decoding, prompts ~{s.stream_prompt_tokens} tokens; "
        f"{s.long_prompt_tokens}-token prompts ({s.long_output_tokens} output tokens) arriving every "
        f"{s.long_interval_s:g} s from t = {s.first_long_at_s:g} s of a {s.window_s:g} s window)",
        "",
        "ITL of the chat streams inside the window, all streams pooled. Percentiles are medians over "
        f"{s.interference_repeats} repeat(s); max and longest step are the worst over repeats; p99 ratios are taken "
        "within each repeat against that repeat's baseline, then the median. Long-prompt TTFT counts from the "
        "scheduled arrival; p50/max pool all repeats.",
        "",
        "| variant | ITL p50 ms | p90 ms | p99 ms | max ms | p99 / baseline p99 | long TTFT p50 ms | long TTFT max ms "
        "| long prompts | ITL samples | longest step ms | contended |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [interference_row(v, rs, baseline) for v, rs in by_variant.items()]
    notes = []
    early = sum(r.streams_ended_early for r in runs)
    if early:
        notes.append(f"{early} stream(s) hit max_tokens inside the window: the window is too long for the context.")
    notes.append(f"Preemptions: {sum(r.preemptions for r in runs)}. Chunking off runs a whole prompt in one step "
                 "(the engine raises the step budget to the model length). With long prompts the streams also "
                 "share their decode steps with the long prompts' own decoding.")
    return lines + ["", *notes, ""] + discarded_note(retries)


def interference_row(v: Variant, rs: list[InterferenceRun], baseline: list[InterferenceRun]) -> str:
    p = {q: median([pct(r.itls, q) for r in rs]) for q in (50, 90, 99)}
    ratio = median([pct(r.itls, 99) / pct(b.itls, 99) for r, b in zip(rs, baseline)])
    ttfts = [t for r in rs for t in r.long_ttfts]
    long_cols = f"{ms(median(ttfts))} | {ms(max(ttfts))}" if ttfts else "– | –"
    return (f"| {v.name} | {ms(p[50])} | {ms(p[90])} | **{ms(p[99])}** | {ms(max(max(r.itls) for r in rs))} | "
            f"{ratio:.1f}× | {long_cols} | {len(ttfts)} | "
            f"{sum(len(r.itls) for r in rs)} | {ms(max(r.steps.longest_step_s for r in rs))} | "
            f"{contention([r.steps for r in rs])} |")


# ------------------------------------------------------------------------------------ main


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file or HF directory (default: the cached default model)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quantization", default="auto", help="auto (the file's weight blocks) | none (dense --dtype)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--num-kv-blocks", type=int, default=2048)
    ap.add_argument("--quick", action="store_true", help="a ~2-minute smoke run")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help='where to write the report ("" = stdout only)')
    return ap.parse_args()


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    args = parse_args()
    s = QUICK if args.quick else Settings()
    if args.threads:
        torch.set_num_threads(args.threads)
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    base = EngineConfig(model=args.model, dtype=args.dtype, quantization=args.quantization, num_kv_blocks=args.num_kv_blocks,
                        max_num_seqs=64, max_num_batched_tokens=512, enable_chunked_prefill=True,
                        enable_prefix_caching=True)
    factory = EngineFactory.load(base)
    factory.warm_up()
    retries = [Retries(s.retries, deadline=t0 + s.retry_until_s) for _ in range(3)]
    throughput = bench_throughput(factory, s, retries[0])
    prefix = bench_prefix_cache(factory, s, retries[1])
    interference = bench_interference(factory, s, retries[2])
    total = time.perf_counter() - t0
    text = "\n".join([*report_header(args, factory, s, (load0, os.getloadavg()[0]), total),
                      *report_throughput(throughput, retries[0], s), *report_prefix(prefix, retries[1], s),
                      *report_interference(interference, retries[2], s)])
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
