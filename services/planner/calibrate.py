"""Service calibration: what a real `pdserve up` adds on top of the bare engine steps.

The engine fits (profile.py) time forward passes alone, in one busy process. Served, a step also
hands off between the event loop and the step thread, tokens cross NATS, the gateway and SSE, and
the worker processes share the cores with those (and with whatever else runs on the machine; the
prefill worker runs at nice 10, so it yields first). Five short runs against a real stack measure
it (`RUNS`, then the lending run):

    prefill   batch-1 TTFT at two prompt lengths:  TTFT = s_p · prefill step + request overhead
    decode    the event gap (one step), in two parts: per request of the batch-1 run, (draft tokens
              verified per event d, mean gap) fitted as gap = plain + spec·d (a speculative step
              verifies its drafts, kept or not; per sequence, see Profile.spec_token_s; τ − 1 stands
              in for d where the server does not report usage.draft_tokens; where the requests'
              d are too alike to read a slope from, the engine's own cost of a row is spec); then
              the plain step fitted as base + per sequence + per context token, each ≥ 0, on batch 1
              at 128 and 768 tokens of context and the batches the `high_batch` streams' and twice
              as many streams' steps held (a chat's batch; fewer than the streams: a stream also
              waits for its next prompt's prefill and KV; how many, a simulation of that run on
              the fit says, iterated) (the profiled step's parts scaled by one factor when no such
              fit exists; on 2 shared cores the per-sequence part comes out small: from 2 sequences
              a decode step borrows the idle prefill worker's core)
    widths    where the stack's engines log their steps (`logging_steps`: `pdserve profile --stack` and
              the accuracy comparison do), the decode fits are read off the engine's own served
              decode steps instead, apart by width (`decode_steps`): on its share of the host and on
              the whole host (on 2 cores a step on both pays ~5 ms more a step and about half as much
              a row), each plus what an event adds to a step (the batch-1 run's gap less its logged
              step); the lending run's decode slowdown is then the widths' (`Profile.decode_wide`)
    handoff   the first decode gap less a step and the kvstore's KV write + read (the profile's
              transfer fits), of the short and the long prompt: a fixed part (the job's hops) and
              one per KV block (what the kvstore paths leave out). Until the KV memory was faulted
              in ahead of use (shared/kvcache/pages.py), that was the first touch of a fresh
              stack's pages: 1.7-2.0 ms a block on an AMX Xeon, from first gaps of 40-55 ms at 128
              tokens and 125-160 ms at 768; since, 0 there (14 ms fixed)
    events    tokens per streamed event τ (speculative decoding delivers several a step; 1 without
              it): the simulator's decode fit is per token, step ÷ τ, and it groups τ token gaps into
              one event gap. τ is the workload's, not the machine's: the same requests got 1.8 and
              2.9 tokens an event in two runs, the second time the suffix proposer had seen their
              answers. `Profile.with_tokens_per_event` moves a profile to another workload's τ and d.
    lending   engines on one host lend each other their cores while idle, and the runs above see the
              lent case: a batch-1 run prefills with the decode worker idle. A fourth run, 2 chat
              streams beside long prompts, measures both pools busy at once: the long prompts' TTFT
              against the lent prefill's, and the streams' event gap while one prefills against
              while none does (`Profile.unlent`; the simulator slows a step that cannot borrow)
    spread    the event gaps' quantiles ÷ their mean (each request's first gap left out: the
              simulator models the KV move in it): how far one step's gap strays from the mean
              when draft lengths vary and threads are descheduled; the simulator spreads its gaps so

and the profile's fits are scaled by what these give. Measured, not assumed: run it in the same
conditions as the runs it should predict (answers as long as theirs: the speculative proposer's
acceptance grows with what it has seen).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from shared.sim.cost import DecodeFit, PrefillFit, Profile

log = logging.getLogger("pdserve.calibrate")


@dataclass(frozen=True)
class CalibrationRun:
    batch: int
    prompt_tokens: int
    output_tokens: int
    itl_mean_s: float
    ttft_p50_s: float
    tpot_mean_s: float = 0.0  # (E2E − TTFT) / (tokens − 1), per request, averaged
    gap_quantiles: tuple[float, ...] = ()  # event gap ÷ the run's mean gap at SHAPE_POINTS (first gaps left out)
    # per request: (tokens per event, mean event gap in s), each after its first event, first gap left out
    per_request: tuple[tuple[float, float], ...] = ()
    first_gap_s: float = 0.0  # the mean gap from the first token to the next event (the KV handoff in it)
    # per request, aligned with per_request: draft tokens its steps verified per event (usage.draft_tokens
    # over its events after the first); empty when the server did not say
    drafts: tuple[float, ...] = ()

    @property
    def tokens_per_event(self) -> float:
        return sum(t for t, _ in self.per_request) / len(self.per_request) if self.per_request else 1.0

    @property
    def extra_rows(self) -> float:
        """Rows a sequence's step verified beyond its one token, per event: the drafts where known,
        else the tokens kept beyond one (τ − 1: a lower bound)."""
        if self.drafts:
            return sum(self.drafts) / len(self.drafts)
        return self.tokens_per_event - 1

    @property
    def event_gap_s(self) -> float:
        return sum(g for _, g in self.per_request) / len(self.per_request) if self.per_request else self.itl_mean_s


@dataclass(frozen=True)
class LendingRun:
    """Two chat streams decoding while long prompts arrive: both pools busy at once, so neither
    borrows the other's cores (shared/engine/cores.py), as they do in the closed-loop runs."""
    prefills: tuple[tuple[int, float], ...]  # the long prompts': (prompt tokens, TTFT s)
    gap_prefilling_s: float  # the streams' mean event gap while a long prompt was prefilled
    gap_alone_s: float  # … and while none was


# (concurrency, prompt tokens, output tokens): answers as long as the cases' (24-48 tokens), and a
# wider batch with a chat's answers, so the decode fit is read off a chat's batch (served: 6 here),
# not extrapolated from batches of 1-3 (BENCHMARKS.md, "Engines on one host's cores": on the AMX
# host the plain step's base went from 8.8 to 13.0 ms, its context term from 5.9 to 3.6 us a token,
# its per-sequence term stayed 1.6 ms). Concurrency beyond 1 is for `high_batch` 4, scaled with it.
# The long prompt's answers (12 tokens until 2026-12-07) give the logged steps' fit a context's reach:
# its row-and-context term moved 0.9-1.9 us between calibrations at 40 tokens (~50 steps), 1.0-1.7 at 96
RUNS = ((1, 128, 40), (1, 768, 96), (4, 128, 40), (8, 128, 96))
# the streams' prompts short (the calibration's short ones), so that the long ones seldom queue behind them
LEND_STREAMS, LEND_PROMPT, LEND_STREAM_PROMPT, LEND_INTERVAL_S, LEND_DURATION_S = 2, 768, 128, 3.0, 12.0
SHAPE_POINTS = tuple((i + 0.5) / 20 for i in range(20))
HOST_REFERENCE_TOKENS = 256  # the prefill point (1 sequence, from 0) both profile grids measure
HOST_SCALE_NOISE = 1.1  # a host's prefill within ~20% of the reference's is the same kind of host


def host_scale(profile: Profile, reference: dict | None = None) -> float:
    """How far to stretch the served runs here, against the host they were sized on (the one the
    shipped CPU profile was measured on, or `reference`: a profile file's JSON with its points):
    √ of how much slower this profile's prefill is, at least 1. The runs' prompts are cut by it
    and their arrivals spread by it, so a prefill pool is as busy as there and a run takes `s`×
    its time, not `s`²× (an AVX2-only Zen 1 prefills ~8× slower than the AVX-512 VNNI Zen 4:
    2.9×); answers keep their length, for their gaps.

    A host within `HOST_SCALE_NOISE` of the reference runs the cases as they are: the bench seeds
    its arrivals by the rate, so a rate scaled by a hair is another sequence of arrivals (a Zen 4
    measuring its prefill 0.4% slower than the reference, 2026-12-07: 10 chat requests in 11 s, not 34)."""
    from shared.sim.cost import DEFAULT_PROFILE

    ref = reference or json.loads(DEFAULT_PROFILE.read_text())
    n = HOST_REFERENCE_TOKENS
    ref_s = next(p["seconds"] for p in ref["prefill"]["points"]
                 if (p["seqs"], p["tokens"], p["offset"]) == (1, n, 0))
    s = math.sqrt(profile.prefill_time(n, n * n / 2, 1) / ref_s)
    return s if s > HOST_SCALE_NOISE else 1.0


def scale_tokens(bounds: tuple[int, int], s: float, least: int = 16) -> tuple[int, int]:
    return tuple(max(least, round(b / s)) for b in bounds)


def first_gap(records) -> float:
    gaps = [r.token_times_s[1] - r.token_times_s[0] for r in records if r.ok and len(r.token_times_s) > 2]
    return sum(gaps) / len(gaps) if gaps else 0.0


def later_gaps(record) -> list[float]:
    """A request's event gaps after its second event (the first decode gap also carries the KV
    move, which the simulator models itself)."""
    t = record.token_times_s
    return [b - a for a, b in zip(t[1:], t[2:])]


def _streamed(records) -> tuple[list, int]:
    """The answered records with an event after their first, and those later events (the decode
    steps a stream saw)."""
    streamed = [r for r in records if r.ok and len(r.token_times_s) > 1]
    return streamed, sum(len(r.token_times_s) - 1 for r in streamed)


def tokens_per_event(records) -> float:
    """Tokens a stream got per event after its first one, over `records` (a workload's acceptance
    with speculative decoding: 1 without it)."""
    streamed, events = _streamed(records)
    return max(1.0, sum(r.output_tokens - 1 for r in streamed) / events) if events else 1.0


def gap_quantiles(records) -> tuple[float, ...]:
    """Quantiles of a run's event gaps (each request's first one left out) ÷ their mean."""
    gaps = sorted(g for r in records if r.ok for g in later_gaps(r))
    if len(gaps) < 10:
        return ()
    mean = sum(gaps) / len(gaps)
    return tuple(gaps[min(len(gaps) - 1, int(q * len(gaps)))] / mean for q in SHAPE_POINTS)


def per_request(records) -> tuple[tuple[tuple[float, float], ...], tuple[float, ...]]:
    """(tokens per event, mean event gap) of each request with gaps to read, and the draft tokens
    each verified per event (empty unless every one of them says)."""
    out, drafts = [], []
    for r in records:
        gaps = later_gaps(r) if r.ok else []
        if len(gaps) >= 2:
            out.append((tokens_per_event([r]), sum(gaps) / len(gaps)))
            drafts.append(drafts_per_event([r]))
    return tuple(out), (tuple(drafts) if None not in drafts else ())


def drafts_per_event(records) -> float | None:
    """Draft tokens verified per event after the first (the decode steps), over `records`; None
    when a record does not say (another server, or no usage sent)."""
    if any(r.draft_tokens is None for r in records):
        return None
    streamed, events = _streamed(records)
    return sum(r.draft_tokens for r in streamed) / events if events else 0.0


def measure_stack(base_url: str, gguf: str | None, high_batch: int = 4, seed: int = 9000,
                  scale: float = 1.0, steps_dir: Path | None = None) -> tuple[list, dict | None]:
    """Closed-loop runs (each its own prompts) against the server at `base_url`, stretched by
    `scale` (`host_scale`): prompts that much shorter, the lending run's arrivals further apart.
    With `steps_dir` (a stack started under `logging_steps` there), the decode steps its engines
    logged after the warm-up, fitted by width (`decode_steps`; None otherwise)."""
    from services.bench.runner import BenchConfig, run_benchmark

    # a fresh stack's first requests pay one-off costs (first calls of each shape, connections):
    # warm it up the way the runs to predict will find it, and measure only after that
    run_benchmark(BenchConfig(base_url, workload="chat", num_requests=6, max_concurrency=high_batch,
                              prompt_tokens=scale_tokens((128, 768), scale), output_tokens=(8, 24), tokenizer=gguf,
                              progress=False, seed=seed - 1))
    since = time.time()
    runs = []
    for k, (batch, prompt, out) in enumerate(RUNS):
        batch = batch * high_batch // 4 if batch > 1 else 1
        n = 3 * batch + 5 if prompt < 512 else 3
        prompt = scale_tokens((prompt, prompt), scale)[0]
        cfg = BenchConfig(base_url, workload="chat", num_requests=n,
                          max_concurrency=batch, prompt_tokens=(prompt, prompt), output_tokens=(out, out),
                          tokenizer=gguf, progress=False, seed=seed + k)
        run = run_benchmark(cfg).runs[0]
        s = run.summary
        if s["failed"]:
            raise RuntimeError(f"calibration run at batch {batch}: {s['failed']} requests failed")
        points, drafts = per_request(run.records)
        runs.append(CalibrationRun(batch, prompt, out, s["itl_ms"]["mean"] / 1e3, s["ttft_ms"]["p50"] / 1e3,
                                   s["tpot_ms"]["mean"] / 1e3, gap_quantiles(run.records), points,
                                   first_gap(run.records), drafts))
        log.info("calibration batch %d, %d-token prompts: ITL mean %.1f ms, TPOT mean %.1f ms, TTFT p50 %.1f ms, "
                 "%.2f tokens per event", batch, prompt, s["itl_ms"]["mean"], s["tpot_ms"]["mean"], s["ttft_ms"]["p50"],
                 runs[-1].tokens_per_event)
    runs.append(measure_lending(base_url, gguf, seed + len(RUNS), scale))
    steps = None if steps_dir is None else decode_steps(steps_dir, since, os.cpu_count() or 1)
    if steps_dir is not None and steps is None:
        log.warning("calibration: too few logged decode steps of each width to fit them apart; one fit for both")
    return runs, steps


def measure_lending(base_url: str, gguf: str | None, seed: int, scale: float = 1.0) -> LendingRun:
    """Long prompts every few seconds beside 2 chat streams: their TTFTs, and the streams' event
    gaps while a long prompt was prefilled vs while none was."""
    from services.bench.runner import BenchConfig, run_benchmark

    prompt = scale_tokens((LEND_PROMPT, LEND_PROMPT), scale)
    cfg = BenchConfig(base_url, workload="interference", max_concurrency=LEND_STREAMS,
                      duration_s=LEND_DURATION_S * scale, warmup_s=scale, long_interval_s=LEND_INTERVAL_S * scale,
                      long_prompt_tokens=prompt,
                      prompt_tokens=scale_tokens((LEND_STREAM_PROMPT, LEND_STREAM_PROMPT), scale),
                      long_output_tokens=(2, 2), interference_phases=("long",), output_tokens=(40, 40),
                      tokenizer=gguf, progress=False, seed=seed)
    records = run_benchmark(cfg).runs[0].records
    longs = [r for r in records if r.kind == "long" and r.ok and r.token_times_s]
    if not longs:
        raise RuntimeError("calibration: no long prompt of the lending run was answered")
    windows = [(r.sent_s, r.token_times_s[0]) for r in longs]
    during, alone = [], []
    for r in records:
        if r.kind != "chat" or not r.ok:
            continue
        t = r.token_times_s
        for a, b in zip(t[1:], t[2:]):
            if any(w0 <= a and b <= w1 for w0, w1 in windows):
                during.append(b - a)
            elif not any(a < w1 and b > w0 for w0, w1 in windows):
                alone.append(b - a)
    if len(during) < 10 or len(alone) < 10:
        raise RuntimeError(f"calibration: too few event gaps in the lending run ({len(during)} during a long "
                           f"prefill, {len(alone)} without)")
    run = LendingRun(tuple((prompt[0], r.ttft_s) for r in longs), sum(during) / len(during), sum(alone) / len(alone))
    log.info("calibration, %d chat streams beside %d-token prompts: TTFT %s ms; event gap %.1f ms while one "
             "prefilled, %.1f ms otherwise", LEND_STREAMS, prompt[0], [round(1e3 * x) for _, x in run.prefills],
             1e3 * run.gap_prefilling_s, 1e3 * run.gap_alone_s)
    return run


def spec_token_cost(points: tuple[tuple[float, float], ...]) -> tuple[float, float]:
    """(event gap at one token an event, seconds per extra token) by least squares over the
    requests' (tokens per event, mean gap); (mean gap, 0) when they do not show a rising line."""
    n = len(points)
    mean_gap = sum(g for _, g in points) / n if n else 0.0
    if n < 3:
        return mean_gap, 0.0
    mt = sum(t for t, _ in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    if var < 0.05 * n:  # acceptance too alike across requests to read a slope from
        return mean_gap, 0.0
    slope = sum((t - mt) * (g - mean_gap) for t, g in points) / var
    intercept = mean_gap - slope * (mt - 1)
    if slope <= 0 or intercept <= 0:
        return mean_gap, 0.0
    return intercept, slope


def _non_negative_fit(rows: np.ndarray, target: np.ndarray) -> np.ndarray | None:
    """Coefficients ≥ 0 with rows @ x closest to target (least squares over every set of free
    coefficients, the others held at 0: three unknowns, eight sets); None if no set fits."""
    best, best_err = None, math.inf
    for mask in range(1, 1 << rows.shape[1]):
        free = np.array([bool(mask >> j & 1) for j in range(rows.shape[1])])
        x = np.zeros(rows.shape[1])
        x[free] = np.linalg.lstsq(rows[:, free], target, rcond=None)[0]
        if np.any(x < 0):
            continue
        err = float(np.sum((rows @ x - target) ** 2))
        if err < best_err - 1e-18:
            best, best_err = x, err
    return best


def _handoff(profile: Profile, run: CalibrationRun) -> tuple[int, float]:
    """(KV blocks of the run's prompt, its first decode gap less a step and the kvstore's KV write + read)."""
    blocks = -(-run.prompt_tokens // profile.limits.block_size)
    kv = profile.transfer_time("shm", blocks * profile.limits.kv_bytes_per_block)
    return blocks, max(0.0, run.first_gap_s - run.event_gap_s - sum(kv))


def _served_batch(profile: Profile, run: CalibrationRun) -> float:
    """The sequences a decode step held in the closed-loop run `run`, as its gaps saw them (Σ B² / Σ B
    over the steps), simulated on `profile`: its streams spend part of their time waiting for their
    prompts' prefill and KV, so fewer than `run.batch` decode at once."""
    from shared.sim.cluster import Cluster, ClosedLoop, ClusterConfig
    from shared.sim.workload import SimRequest

    cluster = Cluster(profile, ClusterConfig())
    cluster.run([], ClosedLoop(lambda i: SimRequest(0.0, run.prompt_tokens, run.output_tokens), run.batch, math.inf,
                               max_requests=max(len(run.per_request), run.batch)))
    rows, squares = cluster.decode_pool[0].decode_rows
    return squares / rows if rows else float(run.batch)


def calibrate(profile: Profile, runs: list, steps: dict | None = None) -> Profile:
    """The profile with its fits scaled to what the served runs showed (`measure_stack`'s runs:
    the CalibrationRuns of RUNS, then a LendingRun; recorded before 2026-12-07, without the wider one).
    `steps`: the served decode steps' fits by width (`decode_steps`), where the runs logged them: the
    decode fits are then those, plus what an event adds to a step (its hops to the client)."""
    short, long, *wide_runs, lending = runs
    wide = wide_runs[0]

    def prefill(r: CalibrationRun) -> float:
        return profile.prefill_time(r.prompt_tokens, r.prompt_tokens ** 2 / 2, 1)

    s_p = (long.ttft_p50_s - short.ttft_p50_s) / (prefill(long) - prefill(short))
    if not 0.5 <= s_p <= 50:  # the difference drowned in noise: the long prompt alone
        s_p = long.ttft_p50_s / prefill(long)
    request_overhead = max(0.0, short.ttft_p50_s - s_p * prefill(short))
    # the first decode gap is a step, the KV move and the decode job's hops: the simulator has the
    # first two (the profile's transfer fits, of the kvstore paths alone), the rest is the handoff:
    # fixed, and per block moved, read off the short and the long prompt
    (b0, h0), (b1, h1) = (_handoff(profile, r) for r in (short, long))
    handoff_per_block = max(0.0, (h1 - h0) / (b1 - b0)) if b1 > b0 else 0.0
    handoff = max(0.0, h0 - handoff_per_block * b0)
    # the closed-loop runs prefill with the decode worker idle, on its cores too; beside streams
    # that decode, a prefill step keeps to its own, and a decode step of 2 sequences to its own
    alone = [s_p * profile.prefill_time(n, n * n / 2, 1) for n, _ in lending.prefills]
    # the median long prompt: one that queued behind another (or a stream's prompt) is no measure
    slowed = [(ttft - request_overhead) / a for (_, ttft), a in zip(lending.prefills, alone)]
    unlent = (max(1.0, float(np.median(slowed))),
              max(1.0, lending.gap_prefilling_s / lending.gap_alone_s))

    # decode, in events: a served step at one token an event (plain decoding) at batch 1 at short
    # and long context and at the wide batch, and what each further token an event adds to each
    # sequence's step (longer drafts verified). The served plain step is fitted on those three
    # points as base + per sequence + per context token, each ≥ 0 (the engine's own split can put
    # a whole part at 0, and on shared cores a step of a few sequences costs little more than one);
    # the profile's parts scaled by one common factor when the points admit no such fit
    # per request (1 + drafts per event, gap) where the drafts are known, else (τ, gap)
    xs = [1 + d for d in short.drafts] if short.drafts else [t for t, _ in short.per_request]
    plain1, spec = spec_token_cost(tuple(zip(xs, (g for _, g in short.per_request))))
    if spec == 0.0:  # the requests too alike to read a slope from: the engine's own cost of a row
        spec = profile.draft_row_s
        plain1 = short.event_gap_s - spec * short.extra_rows
        if plain1 <= 0:
            spec, plain1 = 0.0, short.event_gap_s

    def decode_fit(wide_batches: list[float]) -> DecodeFit:
        """The plain step's fit, the wide runs' steps taken to hold `wide_batches` sequences."""
        points = [(short, 1, plain1)] + [(r, b, r.event_gap_s - spec * b * r.extra_rows)
                                         for r, b in ((long, 1), *zip(wide_runs, wide_batches))]
        rows = np.array([[1.0, b, b * (r.prompt_tokens + r.output_tokens // 2)] for r, b, _ in points])
        fit = _non_negative_fit(rows, np.array([g for _, _, g in points]))
        if fit is None:  # a point at or below zero: the engine's parts, scaled to meet batch 1
            d = profile.decode
            fit = np.array([d.base_s, d.per_seq_s, d.per_ctx_token_s]) * (plain1 / d.decode_time(1, int(rows[0, 2])))
        return DecodeFit(*map(float, fit))

    tau = short.tokens_per_event
    shapes = [r.gap_quantiles for r in (short, wide) if r.gap_quantiles]
    shape = tuple(sum(col) / len(col) for col in zip(*shapes)) if shapes else (1.0,)
    shape = tuple(max(q, 1e-3) / (sum(shape) / len(shape)) for q in shape)  # mean exactly 1
    p = profile.prefill
    prefill_fit = PrefillFit(s_p * p.base_s, s_p * p.per_token_s, s_p * p.per_attn_pair_s, s_p * p.per_seq_s)
    plain = replace(profile, prefill=prefill_fit, decode=decode_fit([r.batch for r in wide_runs]),
                    request_overhead_s=request_overhead,
                    handoff_s=handoff, handoff_per_block_s=handoff_per_block, tokens_per_event=1.0,
                    drafts_per_event=0.0 if short.drafts else None, spec_token_s=spec, itl_shape=shape, unlent=unlent)
    wide_batches = [float(r.batch) for r in wide_runs]
    event_overhead = None
    if steps is not None:  # the engine's own steps, on its share and on the whole host, + an event's hops
        plain, event_overhead = _stepped(plain, short, steps)
        spec = plain.spec_token_s
    else:
        # the wide runs' streams also wait for their prompts' prefill and their KV: their steps held
        # fewer than `batch` sequences. How many, their simulations say (on the fit they give, so again)
        for _ in range(4):
            served = [_served_batch(plain.with_tokens_per_event(r.tokens_per_event, r.extra_rows if r.drafts else None),
                                    r) for r in wide_runs]
            if max(abs(a - b) for a, b in zip(served, wide_batches)) < 0.01:
                break
            wide_batches = served
            plain = replace(plain, decode=decode_fit(wide_batches))
    wide_batch = wide_batches[0]
    unlent = plain.unlent
    plain_fit = plain.decode
    meta = dict(profile.meta) | {"calibration": {
        "prefill_slowdown": s_p, "decode_plain_fit": asdict(plain_fit),
        "spec_token_s": spec, "request_overhead_s": request_overhead, "tokens_per_event": tau,
        "drafts_per_event": short.extra_rows if short.drafts else None, "itl_shape": shape,
        "unlent": unlent, "handoff_s": handoff, "handoff_per_block_s": handoff_per_block, "wide_batch": wide_batch,
        "wide_batches": wide_batches, "runs": [r.__dict__ for r in runs],
        **({} if steps is None else {"decode_steps": steps, "event_overhead_s": event_overhead})}}
    log.info("calibration: prefill ×%.2f, plain decode step %.2f ms + %.2f ms a sequence + %.3f µs a context token, "
             "×%.2f a prefill step and ×%.2f a decode step that cannot borrow, %.1f ms more a sequence's step a "
             "draft (the wide runs' steps held %s), request overhead %.1f ms, handoff %.1f ms + %.2f ms a KV block, "
             "%.2f tokens per event, event gaps p10/p50/p90 at ×%.2f/%.2f/%.2f of the mean",
             s_p, 1e3 * plain_fit.base_s, 1e3 * plain_fit.per_seq_s, 1e6 * plain_fit.per_ctx_token_s, *unlent,
             1e3 * spec, "/".join(f"{b:.2f}" for b in wide_batches), 1e3 * request_overhead, 1e3 * handoff,
             1e3 * handoff_per_block, tau,
             shape[len(shape) // 10], shape[len(shape) // 2], shape[len(shape) * 9 // 10])
    if event_overhead is not None:
        w = plain.decode_wide
        log.info("calibration, the engine's logged decode steps: on its share %.2f ms + %.2f ms a sequence + %.2f ms "
                 "a draft row, on the whole host %.2f ms + %.2f ms + %.2f ms (each with %.1f ms an event adds)",
                 1e3 * plain_fit.base_s, 1e3 * plain_fit.per_seq_s, 1e3 * spec, 1e3 * w.base_s, 1e3 * w.per_seq_s,
                 1e3 * plain.spec_token_wide_s, 1e3 * event_overhead)
    plain = replace(plain, meta=meta)
    return plain.with_tokens_per_event(tau, short.extra_rows if short.drafts else None)


def _stepped(plain: Profile, short: CalibrationRun, steps: dict) -> tuple[Profile, float]:
    """`plain` with its decode fits read off the served engine's steps (`decode_steps`): on its share
    of the host (`decode`, `spec_token_s`) and on the whole host (`decode_wide`, `spec_token_wide_s`),
    each plus what an event adds to a step: the engine loop's time between two steps, where the log
    measured it (since 2026-12-07), else the batch-1 run's event gap less its logged step (a
    difference of two means: it read 0 in every run, where the loop takes ~1 ms). The decode
    slowdown the lending run saw is then the width's (a step of 2 streams on one core while the
    other prefills), not a factor more (unlent's decode part 1). A context term per row (fitted
    since 2026-12-07) is the plain step's, and each draft's (`spec_ctx_token_s`)."""
    share, wide = steps["share"], steps["wide"]
    ctx, per_ctx = short.prompt_tokens + short.output_tokens // 2, share["per_ctx_token_s"]
    spec_ctx = per_ctx if share.get("ctx_per") == "row" else 0.0
    overhead = share.get("between_steps_s")
    if overhead is None:  # logged before 2026-12-07: the batch-1 gap less its fitted step
        step = (share["base_s"] + share["per_seq_s"] + (share["per_draft_s"] + spec_ctx * ctx) * short.extra_rows
                + per_ctx * ctx)
        overhead = max(0.0, short.event_gap_s - step)
    return replace(plain, decode=DecodeFit(share["base_s"] + overhead, share["per_seq_s"], per_ctx),
                   spec_token_s=share["per_draft_s"],
                   decode_wide=DecodeFit(wide["base_s"] + overhead, wide["per_seq_s"], per_ctx),
                   spec_token_wide_s=wide["per_draft_s"], spec_ctx_token_s=spec_ctx,
                   unlent=(plain.unlent[0], 1.0)), overhead


STEP_LOG = "steps-{pid}.jsonl"  # PDSERVE_STEP_LOG's file in a calibration stack's workdir, one per worker
MIN_STEPS = 50  # served decode steps of a width before it is fitted
BUSY_GAP_S = 0.02  # a pause between two decode steps shorter than this is the engine's loop, not its idling


@contextmanager
def logging_steps(workdir: Path):
    """Engine workers started inside log their steps into `workdir` (PDSERVE_STEP_LOG)."""
    before = os.environ.get("PDSERVE_STEP_LOG")
    os.environ["PDSERVE_STEP_LOG"] = str(Path(workdir) / STEP_LOG)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PDSERVE_STEP_LOG", None)
        else:
            os.environ["PDSERVE_STEP_LOG"] = before


def _logged_steps(workdir: Path, since: float, until: float = math.inf) -> list[list[dict]]:
    """Each engine's logged steps in `workdir` from `since` to `until` (time.time()), in order."""
    out = []
    for path in sorted(Path(workdir).glob(STEP_LOG.replace("{pid}", "*"))):
        steps = []
        for line in path.read_text().splitlines():
            try:
                r = json.loads(line)
            except ValueError:  # a worker stopped mid-line
                continue
            if since <= r["t"] < until:
                steps.append(r)
        out.append(steps)
    return out


def _decode_only(r: dict) -> bool:
    return bool(r["decode_seqs"]) and not r["prompt_seqs"]


def logged_decode_steps(workdir: Path, since: float, until: float = math.inf) -> list[dict]:
    """The decode steps (no prompt's chunk in them) the engines logged in `workdir` from `since` to
    `until` (time.time())."""
    return [r for steps in _logged_steps(workdir, since, until) for r in steps if _decode_only(r)]


def between_decode_steps(workdir: Path, since: float) -> float | None:
    """The mean time an engine's loop takes between two decode steps back to back (the next one's
    start less the last one's end, under `BUSY_GAP_S`): scheduling, sampling's bookkeeping, the
    tokens' publishing. A stream's event gap is its step and this (0.80-1.14 ms in twelve 1 + 1
    calibrations on 2 AMX cores, on one core and on two alike), which the logged step's seconds do
    not hold. None without two such steps."""
    return _between(_logged_steps(workdir, since))


def _between(engines: list[list[dict]]) -> float | None:
    pauses = [b["t"] - b["s"] - a["t"] for steps in engines
              for a, b in zip(steps, steps[1:]) if _decode_only(a) and _decode_only(b)]
    pauses = [x for x in pauses if 0.0 <= x < BUSY_GAP_S]
    return sum(pauses) / len(pauses) if pauses else None


def _step_terms(r: dict) -> list[float]:
    """A logged decode step's terms: 1, sequences, draft rows, rows × context (logged before
    2026-12-07 without the last: each sequence's rows taken as the step's mean)."""
    row_ctx = r.get("decode_row_ctx", r["decode_ctx"] * r["decode_rows"] / r["decode_seqs"])
    return [1.0, r["decode_seqs"], r["decode_rows"] - r["decode_seqs"], row_ctx]


def decode_steps(workdir: Path, since: float, cores: int) -> dict | None:
    """The served decode steps logged in `workdir` since `since` (time.time()), fitted per width as
    base + per sequence + per draft row + per row and context token (seconds, each ≥ 0): "share" on
    the calibration's share of the host's `cores` (half), "wide" on all of them. The context term is
    per row, a draft's too: each row attends over its sequence's context, so a draft costs more in a
    long document than in a chat (per sequence only, a fit of chat's steps read long-doc's 8–20%
    short). It is one for both widths (the runs' contexts are too alike within a width to tell it
    from the per-sequence term: alone, the wide steps' came out 3× the share's, and chat's wide steps
    24% too slow). None unless each width has `MIN_STEPS` (a host of one core has one width)."""
    engines = _logged_steps(workdir, since)  # read once: the fit's steps, and the loop's time between them
    steps = [r for e in engines for r in e if _decode_only(r)]
    widths = {"share": max(1, cores // 2), "wide": cores}
    counts = {name: sum(r["threads"] == t for r in steps) for name, t in widths.items()}
    if cores < 2 or min(counts.values()) < MIN_STEPS:
        return None
    rows, target = [], []
    for r in steps:
        if r["threads"] not in widths.values():
            continue
        *one, row_ctx = _step_terms(r)
        rows.append(one + [0.0] * 3 + [row_ctx] if r["threads"] == widths["share"] else [0.0] * 3 + one + [row_ctx])
        target.append(r["s"])
    fit = _non_negative_fit(np.array(rows), np.array(target))
    if fit is None:
        return None
    between = _between(engines)
    return {name: {"threads": t, "steps": counts[name], "base_s": float(fit[3 * i]), "per_seq_s": float(fit[3 * i + 1]),
                   "per_draft_s": float(fit[3 * i + 2]), "per_ctx_token_s": float(fit[6]), "ctx_per": "row"}
            | ({} if between is None else {"between_steps_s": between})
            for i, (name, t) in enumerate(widths.items())}


def step_fit_error(steps: dict, logged: list[dict]) -> dict | None:
    """How the calibration's fits (`decode_steps`) read other logged decode steps, by width: the
    steps, their mean seconds and the fits' mean for them, and the relative error. What it says
    apart from a simulation's latencies: whether a miss lies in the step model or outside the
    engine (the event's path to the client, the cores' other processes). None where no logged step
    is on a fitted width."""
    out = {}
    for name, fit in steps.items():
        mine = [r for r in logged if r["threads"] == fit["threads"]]
        if not mine:
            continue
        per_row = fit.get("ctx_per") == "row"
        coef = (fit["base_s"], fit["per_seq_s"], fit["per_draft_s"], fit["per_ctx_token_s"])
        real = sum(r["s"] for r in mine) / len(mine)
        fitted = sum(float(np.dot(coef, _step_terms(r) if per_row else _step_terms(r)[:3] + [r["decode_ctx"]]))
                     for r in mine) / len(mine)
        out[name] = {"steps": len(mine), "real_ms": 1e3 * real, "fit_ms": 1e3 * fitted, "error": (fitted - real) / real}
    return out or None


def recalibrate(profile: Profile) -> Profile:
    """A calibrated profile calibrated again, by the code as it is now, from the served runs it
    records (`meta["calibration"]["runs"]`) on the engine's prefill fit it was scaled from: a change
    to `calibrate` checked against real runs recorded before it (tests/sim/test_accuracy_replay.py).
    The engine's own decode fit is not kept (calibration replaces it), so the fallback that scales it
    when the served points admit no fit starts from the calibrated one."""
    cal = profile.meta["calibration"]
    *served, lending = cal["runs"]

    def tuples(v):
        return tuple(tuples(x) for x in v) if isinstance(v, list) else v

    runs = [CalibrationRun(**{k: tuples(v) for k, v in r.items()}) for r in served]
    s, p = cal["prefill_slowdown"], profile.prefill
    unscaled = PrefillFit(p.base_s / s, p.per_token_s / s, p.per_attn_pair_s / s, p.per_seq_s / s)
    engine = replace(profile, prefill=unscaled, decode_wide=None, spec_token_wide_s=0.0, spec_ctx_token_s=0.0,
                     meta={k: v for k, v in profile.meta.items() if k != "calibration"})
    return calibrate(engine, runs + [LendingRun(**{k: tuples(v) for k, v in lending.items()})], cal.get("decode_steps"))


def engine_up_args(engine) -> list[str]:
    """`pdserve up` flags giving its workers the engine the profile measured."""
    return ["--dtype", str(engine.dtype), "--quantization", str(engine.quantization or "none")]


def calibrate_on_new_stack(profile: Profile, up_args: list[str] | None = None) -> Profile:
    """Start a `pdserve up` (default settings), measure, stop it."""
    from services.up import add_up_args, start_stack, wait_healthy
    from shared.model.hub import resolve_model_path
    from shared.transport.servers import free_port

    parser = argparse.ArgumentParser()
    add_up_args(parser)
    args = parser.parse_args(["--port", str(free_port()), "--workdir", tempfile.mkdtemp(prefix="pdserve-cal-"),
                              *(up_args or [])])
    with logging_steps(args.workdir):
        stack, url = start_stack(args)
    try:
        wait_healthy(stack, url, timeout=180)
        runs, steps = measure_stack(url, str(resolve_model_path(args.model)), scale=host_scale(profile),
                                    steps_dir=Path(args.workdir))
        return calibrate(profile, runs, steps)
    finally:
        stack.stop()


