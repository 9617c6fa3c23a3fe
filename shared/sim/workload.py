"""What the simulator serves: requests as plain numbers (arrival, prompt and output lengths, the
prompt's shareable prefix), never their text.

Sources, all deterministic:
    bench workloads   `pdserve bench`'s seeded workloads: the same lengths for request i, and the
                      same Poisson send times, as a real `pdserve bench` run with that seed
    JSONL trace       {"arrival_s"|"timestamp" (ms), "prompt_tokens"|"input_length",
                       "output_tokens"|"output_length", "prefix_id"?, "prefix_tokens"?} per line
    Mooncake trace    {"timestamp" (ms), "input_length", "output_length", "hash_ids": [...]} per line;
                      each hash id names one 512-token block of the prompt (chained: equal leading ids
                      = an equal prefix), which is what the prefix cache keys on
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path

from services.bench import workloads as bench_workloads  # the seeded generators, reused as they are

MOONCAKE_BLOCK_TOKENS = 512

# Tokens the bench's prompt templates add around the generated body (SmolLM2's tokenizer):
# chat "…\nWrite a long answer about the text above.", long-doc "Document:\n…\nSummarise the document above."
TEMPLATE_TOKENS = {"chat": 10, "long-doc": 11, "shared-prefix": 24}


@dataclass(slots=True)
class SimRequest:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    kind: str = "chat"
    prefix_keys: tuple = ()  # prefix-cache keys of the prompt's leading shareable blocks, in order
    prefix_key_tokens: int = 16  # tokens each key covers

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.output_tokens < 1 or not self.arrival_s >= 0:
            raise ValueError(f"bad request: {self.prompt_tokens} prompt / {self.output_tokens} output tokens "
                             f"at {self.arrival_s} s")


@dataclass
class Load:
    """Running totals of the work done, as a gateway's counters show them (a planner takes their
    differences per interval)."""

    finished: float = 0.0  # requests
    output_tokens: float = 0.0  # theirs
    prefilled: float = 0.0  # prompts counted in `prompt_tokens` and `prefill_s` (a gateway: the finished ones)
    prompt_tokens: float = 0.0
    prefill_s: float = 0.0  # engine seconds the prompts took (their uncached tokens)

    def __sub__(self, other: Load) -> Load:
        return Load(*(getattr(self, f.name) - getattr(other, f.name) for f in fields(self)))

    def __add__(self, other: Load) -> Load:
        return Load(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


@dataclass(frozen=True)
class Mix:
    """The recent requests, per request: what sizing a pool for a rate needs to know of them."""

    prefill_s: float
    prompt_tokens: float
    output_tokens: float
    # how much longer decode steps ran than the profile says, as observed (ITL at the batch seen)
    decode_factor: float = 1.0

    @classmethod
    def of(cls, load: Load) -> Mix | None:
        """The means over `load` (None: nothing finished in it)."""
        if load.finished <= 0 or load.prefilled <= 0:
            return None
        return cls(load.prefill_s / load.prefilled, load.prompt_tokens / load.prefilled,
                   max(1.0, load.output_tokens / load.finished))


def bench_request(workload: bench_workloads.Workload, index: int, arrival_s: float) -> SimRequest:
    """Request `index` of a bench workload, with the lengths `Workload.request(index)` draws (no text)."""
    rng = bench_workloads._rng(workload.seed, workload.name, index)  # the same draws, in the same order
    n_prompt = bench_workloads._pick(rng, workload.prompt_tokens)
    n_out = bench_workloads._pick(rng, workload.output_tokens)
    kind = {"chat": "chat", "long-doc": "long"}.get(workload.name, workload.name)
    if workload.name == "shared-prefix":
        prefix = workload.prefix_tokens + TEMPLATE_TOKENS["shared-prefix"]
        keys = tuple(("shared", workload.seed, b) for b in range(prefix // 16))
        return SimRequest(arrival_s, prefix + n_prompt + 4, n_out, kind, keys, 16)
    return SimRequest(arrival_s, n_prompt + TEMPLATE_TOKENS[workload.name], n_out, kind)


def poisson_requests(name: str, rate: float, seed: int = 0, *, duration_s: float | None = None,
                     num_requests: int | None = None, first_index: int = 0,
                     prompt_tokens: tuple[int, int] | None = None,
                     output_tokens: tuple[int, int] | None = None) -> Iterator[SimRequest]:
    """A bench workload at Poisson `rate` (bench's own send times), until the duration or count."""
    if duration_s is None and num_requests is None:
        raise ValueError("give a duration or a number of requests")
    wl = bench_workloads.Workload(name, seed, prompt_tokens=prompt_tokens, output_tokens=output_tokens)
    for i, at in zip(itertools.count(), bench_workloads.poisson_offsets(rate, seed)):
        if (num_requests is not None and i >= num_requests) or (duration_s is not None and at >= duration_s):
            return
        yield bench_request(wl, first_index + i, at)


def read_trace(path: str | Path, *, time_scale: float = 1.0, limit: int | None = None) -> list[SimRequest]:
    """A JSONL trace (plain or Mooncake-style), or a `pdserve bench --out` result (its first run's
    answered requests: when each was sent, its prompt and the tokens it got), sorted by arrival;
    `time_scale` < 1 compresses time."""
    text = Path(path).read_text()
    bench = bench_records(text)
    rows = ({"arrival_s": r["sent_s"], "prompt_tokens": r["prompt_tokens"], "output_tokens": r["output_tokens"],
             "kind": r.get("kind", "trace")} for r in bench) if bench is not None else text.splitlines()
    out = []
    for n, row in enumerate(rows, 1):
        if isinstance(row, str) and not row.strip():
            continue
        try:
            out.append(_trace_row(json.loads(row) if isinstance(row, str) else row, time_scale))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}:{n}: {exc}") from None
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise ValueError(f"{path}: no requests in the trace")
    out.sort(key=lambda r: r.arrival_s)
    t0 = out[0].arrival_s
    for r in out:
        r.arrival_s -= t0
    return out


def bench_records(text: str) -> list[dict] | None:
    """The answered requests of a `pdserve bench --out` result's first run; None if `text` is not one."""
    if not text.lstrip().startswith("{"):
        return None
    try:
        data = json.loads(text)
    except ValueError:
        return None  # a JSONL trace's first line
    if not isinstance(data, dict) or not data.get("runs"):
        return None
    return [r for r in data["runs"][0].get("records", []) if r.get("status") == "ok" and r.get("output_tokens")]


def bench_acceptance(path: str | Path) -> tuple[float, float | None] | None:
    """(tokens per event, draft tokens verified per event) the requests of a bench result got after
    their first event (speculative decoding's acceptance on that workload); None for a trace."""
    records = bench_records(Path(path).read_text())
    if not records:
        return None
    events = sum(max(0, len(r.get("token_times_s") or []) - 1) for r in records)
    if not events:
        return None
    tau = max(1.0, sum(r["output_tokens"] - 1 for r in records) / events)
    drafts = None if any(r.get("draft_tokens") is None for r in records) else \
        sum(r["draft_tokens"] for r in records) / events
    return tau, drafts


def _trace_row(row: dict, time_scale: float) -> SimRequest:
    at = float(row["arrival_s"]) if "arrival_s" in row else float(row["timestamp"]) / 1000.0
    prompt = int(row.get("prompt_tokens", row.get("input_length", 0)))
    output = int(row.get("output_tokens", row.get("output_length", 0)))
    if "hash_ids" in row:  # Mooncake: one key per 512-token block, only whole blocks are shareable
        ids = row["hash_ids"][: prompt // MOONCAKE_BLOCK_TOKENS]
        return SimRequest(at * time_scale, prompt, output, row.get("kind", "trace"), tuple(ids), MOONCAKE_BLOCK_TOKENS)
    keys: tuple = ()
    if row.get("prefix_id") is not None:
        pid, ptok = row["prefix_id"], min(int(row.get("prefix_tokens", 0)), prompt - 1)
        keys = tuple((pid, b) for b in range(ptok // 16))
    return SimRequest(at * time_scale, prompt, output, row.get("kind", "trace"), keys, 16)


def mooncake_shaped_trace(duration_s: float, rate: float, seed: int = 0, *, mean_input: float = 7590,
                          mean_output: float = 182, prefix_share: float = 0.5, max_input: int = 32_000,
                          period_s: float | None = None) -> Iterator[dict]:
    """Rows of a synthetic trace with the published shape of Mooncake's public trace (Qin et al.,
    2024: mean input 7,590 tokens, mean output 182, about half the prompt tokens reusable as cached
    prefix), log-normal lengths, Poisson arrivals whose rate swings ±50% over `period_s` (diurnal).
    Synthesized from those summary figures: not the trace file itself (nothing is downloaded)."""
    import random

    rng = random.Random(f"{seed}:mooncake")
    sigma_in, sigma_out = 0.9, 0.8
    mu_in, mu_out = math.log(mean_input) - sigma_in**2 / 2, math.log(mean_output) - sigma_out**2 / 2
    n_prefixes = 200  # shared documents / system prompts, Zipf-popular
    weights = [1 / (k + 1) for k in range(n_prefixes)]
    t = 0.0
    while True:
        r = rate if period_s is None else rate * (1 + 0.5 * math.sin(2 * math.pi * t / period_s))
        t += rng.expovariate(max(r, 1e-9))
        if t >= duration_s:
            return
        prompt = max(16, min(max_input, int(rng.lognormvariate(mu_in, sigma_in))))
        output = max(1, min(4096, int(rng.lognormvariate(mu_out, sigma_out))))
        blocks = prompt // MOONCAKE_BLOCK_TOKENS
        shared = int(blocks * prefix_share * 2 * rng.random()) if rng.random() < 0.8 else 0
        doc = rng.choices(range(n_prefixes), weights)[0]
        uid = rng.getrandbits(40)
        ids = [doc * 1_000_000 + b for b in range(min(shared, blocks))] + \
              [uid * 10_000 + b for b in range(min(shared, blocks), blocks)]
        yield {"timestamp": round(t * 1000, 3), "input_length": prompt, "output_length": output, "hash_ids": ids}
