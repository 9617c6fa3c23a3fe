"""Service calibration: what a real `pdserve up` adds on top of the bare engine steps.

The engine fits (profile.py) time forward passes alone, in one busy process. Served, a step also
hands off between the event loop and the step thread, tokens cross NATS, the gateway and SSE, and
the worker processes share the cores with those (and with whatever else runs on the machine; the
prefill worker runs at nice 10, so it yields first). Three short runs against a real stack measure
it, each pool on its own:

    prefill   batch-1 TTFT at two prompt lengths:  TTFT = s_p · prefill step + request overhead
    decode    TPOT at batch 1 and batch `high_batch`: TPOT = s_d · decode step  (s_d: their geometric mean)
    events    tokens per streamed event = ITL / TPOT (speculative decoding delivers several a step;
              1 without it): the simulator groups that many token gaps into one event gap

and the profile's fits are scaled by s_p and s_d. A multiplicative decode slowdown, rather than a
two-point line, because on a shared machine the two points are often noisier than their difference.
Measured, not assumed: run it in the same conditions as the runs it should predict.
"""

from __future__ import annotations

import argparse
import logging
import math
import tempfile
from dataclasses import dataclass, replace

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


RUNS = ((1, 128, 24), (1, 768, 4), (4, 128, 24))  # (concurrency, prompt tokens, output tokens)


def measure_stack(base_url: str, gguf: str | None, high_batch: int = 4, seed: int = 9000) -> list[CalibrationRun]:
    """Closed-loop runs (each its own prompts) against the server at `base_url`."""
    from services.bench.runner import BenchConfig, run_benchmark

    # a fresh stack's first requests pay one-off costs (first calls of each shape, connections):
    # warm it up the way the runs to predict will find it, and measure only after that
    run_benchmark(BenchConfig(base_url, workload="chat", num_requests=6, max_concurrency=high_batch,
                              prompt_tokens=(128, 768), output_tokens=(8, 24), tokenizer=gguf, progress=False,
                              seed=seed - 1))
    runs = []
    for k, (batch, prompt, out) in enumerate(RUNS):
        batch = high_batch if batch > 1 else 1
        cfg = BenchConfig(base_url, workload="chat", num_requests=2 * batch + 1, max_concurrency=batch,
                          prompt_tokens=(prompt, prompt), output_tokens=(out, out), tokenizer=gguf, progress=False,
                          seed=seed + k)
        s = run_benchmark(cfg).runs[0].summary
        if s["failed"]:
            raise RuntimeError(f"calibration run at batch {batch}: {s['failed']} requests failed")
        runs.append(CalibrationRun(batch, prompt, out, s["itl_ms"]["mean"] / 1e3, s["ttft_ms"]["p50"] / 1e3,
                                   s["tpot_ms"]["mean"] / 1e3))
        log.info("calibration batch %d, %d-token prompts: ITL mean %.1f ms, TPOT mean %.1f ms, TTFT p50 %.1f ms",
                 batch, prompt, s["itl_ms"]["mean"], s["tpot_ms"]["mean"], s["ttft_ms"]["p50"])
    return runs


def calibrate(profile: Profile, runs: list[CalibrationRun]) -> Profile:
    """The profile with its fits scaled to what the served runs showed."""
    short, long, wide = runs

    def prefill(r: CalibrationRun) -> float:
        return profile.prefill_time(r.prompt_tokens, r.prompt_tokens ** 2 / 2, 1)

    def decode(r: CalibrationRun) -> float:  # mean context over the answer
        return profile.decode_time(r.batch, r.batch * (r.prompt_tokens + r.output_tokens // 2))

    s_p = (long.ttft_p50_s - short.ttft_p50_s) / (prefill(long) - prefill(short))
    if not 0.5 <= s_p <= 50:  # the difference drowned in noise: the long prompt alone
        s_p = long.ttft_p50_s / prefill(long)
    request_overhead = max(0.0, short.ttft_p50_s - s_p * prefill(short))
    s_d = math.sqrt(short.tpot_mean_s / decode(short) * wide.tpot_mean_s / decode(wide))
    tau = max(1.0, math.sqrt(short.itl_mean_s / short.tpot_mean_s * wide.itl_mean_s / wide.tpot_mean_s))
    d, p = profile.decode, profile.prefill
    decode_fit = DecodeFit(s_d * d.base_s, s_d * d.per_seq_s, s_d * d.per_ctx_token_s)
    prefill_fit = PrefillFit(s_p * p.base_s, s_p * p.per_token_s, s_p * p.per_attn_pair_s, s_p * p.per_seq_s)
    meta = dict(profile.meta) | {"calibration": {"prefill_slowdown": s_p, "decode_slowdown": s_d,
                                                 "request_overhead_s": request_overhead, "tokens_per_event": tau,
                                                 "runs": [r.__dict__ for r in runs]}}
    log.info("calibration: prefill ×%.2f, decode ×%.2f, request overhead %.1f ms, %.2f tokens per event", s_p, s_d,
             1e3 * request_overhead, tau)
    return replace(profile, prefill=prefill_fit, decode=decode_fit, request_overhead_s=request_overhead,
                   tokens_per_event=tau, meta=meta)


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
    stack, url = start_stack(args)
    try:
        wait_healthy(stack, url, timeout=180)
        return calibrate(profile, measure_stack(url, str(resolve_model_path(args.model))))
    finally:
        stack.stop()


