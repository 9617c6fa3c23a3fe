"""The benchmark as a library: `run_benchmark(BenchConfig) -> BenchResult`.

A run sends one workload's requests and waits for every one of them to end. Arrivals:

    open loop     Poisson at `request_rate` (seeded), optionally capped at `max_concurrency` in flight
    closed loop   rate inf + `max_concurrency` C: a new request as soon as one of C ends
    interference  C chat streams back to back (closed loop) for `duration_s`, while long-doc prompts
                  arrive at warmup_s, warmup_s + long_interval_s, …; chat ITLs are counted from
                  warmup_s on. Run twice, without and with the long prompts (the baseline first),
                  and the chat streams' ITL p99 ratio is reported.

Several rates (a sweep) give one run each, in the order given. Each run (each rate, each
interference phase) draws its own requests (indices from run × RUN_INDEX_STRIDE), so no prompt is
sent twice to one server: a repeat would hit its prefix cache and look faster. Nothing is dropped:
a request that fails is a record with its status, and the summary checks completed + failed = sent.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any

import httpx

from services.bench.client import RequestRecord, Target, make_http_client, send
from services.bench.metrics import SLO, summarize
from services.bench.progress import Progress
from services.bench.workloads import WORKLOADS, Dataset, TextGenerator, Workload, poisson_offsets, tokenizer_counter

RUN_INDEX_STRIDE = 1_000_000  # run k sends requests k·stride, k·stride + 1, … (a dataset cycles regardless)


@dataclass
class BenchConfig:
    base_url: str
    model: str | None = None  # None: the first model the server lists
    endpoint: str = "completions"  # "completions" | "chat"
    workload: str = "chat"  # one of workloads.WORKLOADS (ignored when `dataset` is given)
    dataset: str | None = None
    num_requests: int | None = None
    duration_s: float | None = None  # stop sending after this long (interference: the window)
    request_rates: tuple[float, ...] = (math.inf,)  # req/s; several = a sweep, one run each
    max_concurrency: int | None = None
    seed: int = 0
    prompt_tokens: tuple[int, int] | None = None  # override the workload's ranges (inclusive)
    output_tokens: tuple[int, int] | None = None
    prefix_tokens: int = 1200  # shared-prefix: the prefix's length; doc-qa: each user's document's
    users: int = 8  # doc-qa: users, each with their own document
    long_interval_s: float = 5.0  # interference: a long-doc prompt every this many seconds
    long_prompt_tokens: tuple[int, int] | None = None
    long_output_tokens: tuple[int, int] | None = None
    warmup_s: float = 3.0  # interference: first long prompt, and the start of the ITL window
    interference_phases: tuple[str, ...] = ("baseline", "long")  # run in this order
    temperature: float = 0.0
    ignore_eos: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)
    api_key: str | None = None
    request_timeout_s: float = 600.0
    slo: SLO = SLO()
    tokenizer: str | None = None  # GGUF / HF dir: exact prompt lengths
    progress: bool = True
    label: str = ""

    def __post_init__(self) -> None:
        if self.endpoint not in ("completions", "chat"):
            raise ValueError(f"endpoint must be 'completions' or 'chat', got {self.endpoint!r}")
        if self.dataset is None and self.workload not in WORKLOADS:
            raise ValueError(f"unknown workload {self.workload!r} (one of {', '.join(WORKLOADS)})")
        if not self.request_rates or any(not r > 0 for r in self.request_rates):
            raise ValueError("request rates must be > 0 (inf: send as fast as allowed)")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("max concurrency must be >= 1")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError("the number of requests must be >= 1")
        if self.interference:
            if self.duration_s is None or self.max_concurrency is None:
                raise ValueError("the interference workload needs a duration and a max concurrency (the chat streams)")
            if len(self.request_rates) > 1 or self.request_rates[0] != math.inf:
                raise ValueError("the interference workload runs at fixed concurrency; no request rate")
            if not set(self.interference_phases) <= {"baseline", "long"} or not self.interference_phases:
                raise ValueError("interference phases: 'baseline' and/or 'long'")
        elif self.num_requests is None and self.duration_s is None:
            raise ValueError("give a number of requests, a duration, or both")
        elif self.num_requests is None and self.max_concurrency is None and math.inf in self.request_rates:
            raise ValueError("a duration alone at rate inf without a concurrency cap would send without end")

    @property
    def interference(self) -> bool:
        return self.dataset is None and self.workload == "interference"


@dataclass
class RunResult:
    label: str
    request_rate: float
    max_concurrency: int | None
    duration_s: float
    records: list[RequestRecord]
    summary: dict[str, Any]
    long_arrivals_s: list[float] = field(default_factory=list)  # interference: send times of the long prompts
    itl_from_s: float | None = None  # ITLs before this run time are not in the summary
    # the wall-clock time (time.time()) of the run's start, which its records' times count from: what
    # lines them up with the servers' own logs (traces, PDSERVE_STEP_LOG)
    started_unix_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {"label": self.label, "request_rate": _finite(self.request_rate), "max_concurrency": self.max_concurrency,
                "duration_s": self.duration_s, "long_arrivals_s": self.long_arrivals_s, "itl_from_s": self.itl_from_s,
                "started_unix_s": self.started_unix_s, "summary": self.summary,
                "records": [r.to_json() for r in self.records]}


@dataclass
class BenchResult:
    config: BenchConfig
    model: str
    started_at: str
    runs: list[RunResult]

    @property
    def interference(self) -> dict[str, Any] | None:
        """Chat streams' ITL p99 with long prompts ÷ without (when both phases ran)."""
        phases = {r.label: chat_summary(r) for r in self.runs}
        base, long = phases.get("baseline"), phases.get("with long prompts")
        if not base or not long or not base.get("itl_ms") or not long.get("itl_ms"):
            return None
        b, w = base["itl_ms"]["p99"], long["itl_ms"]["p99"]
        return {"chat_itl_p99_ms_baseline": b, "chat_itl_p99_ms_with_long": w, "ratio": w / b if b > 0 else None}

    def to_json(self) -> dict[str, Any]:
        config = asdict(self.config) | {"request_rates": [_finite(r) for r in self.config.request_rates],
                                        "api_key": "***" if self.config.api_key else None}
        return {"model": self.model, "started_at": self.started_at, "config": config,
                "interference": self.interference, "runs": [r.to_json() for r in self.runs]}


def chat_summary(run: RunResult) -> dict[str, Any]:
    """The chat streams' part of a run's summary (the whole summary when chat is all it sent)."""
    return run.summary.get("by_kind", {}).get("chat", run.summary)


def _finite(x: float) -> float | str:
    return x if math.isfinite(x) else "inf"


def run_benchmark(config: BenchConfig) -> BenchResult:
    return asyncio.run(run_benchmark_async(config))


async def run_benchmark_async(config: BenchConfig, transport: httpx.AsyncBaseTransport | None = None) -> BenchResult:
    """`transport`: an in-process fake server (tests); None: real HTTP."""
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    model = config.model or await fetch_model_name(config.base_url, config.api_key)
    target = Target(config.base_url, model, config.endpoint, config.temperature, config.ignore_eos, config.api_key,
                    dict(config.extra_body), config.request_timeout_s)
    text = TextGenerator(tokenizer_counter(config.tokenizer) if config.tokenizer else None)
    runs: list[RunResult] = []
    max_connections = max(64, 4 * (config.max_concurrency or 16))
    async with make_http_client(max_connections, config.request_timeout_s, transport) as client:
        if config.interference:
            chat = Workload("chat", config.seed, prompt_tokens=config.prompt_tokens,
                            output_tokens=config.output_tokens, text=text)
            long = Workload("long-doc", config.seed, prompt_tokens=config.long_prompt_tokens,
                            output_tokens=config.long_output_tokens, text=text)
            for phase in config.interference_phases:  # each phase its own chat prompts, whatever the order
                with_long = phase == "long"
                runs.append(await _run_interference(config, target, client, chat, long, with_long,
                                                    first_chat=RUN_INDEX_STRIDE if with_long else 0))
        else:
            workload = Dataset(config.dataset) if config.dataset else Workload(
                config.workload, config.seed, prompt_tokens=config.prompt_tokens, output_tokens=config.output_tokens,
                prefix_tokens=config.prefix_tokens, text=text, users=config.users)
            for k, rate in enumerate(config.request_rates):
                runs.append(await _run_open(config, target, client, workload, rate, first=k * RUN_INDEX_STRIDE))
    return BenchResult(config, model, started, runs)


async def fetch_model_name(base_url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = f"{base_url.rstrip('/')}/v1/models"
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            resp = await client.get(url, headers=headers)
            resp.raise_for_status()
            data = resp.json().get("data") or []
    except httpx.HTTPError as exc:
        raise ValueError(f"cannot list the models at {url} ({exc}); is the server up? (or pass --model)") from None
    if not data:
        raise ValueError(f"{base_url}/v1/models lists no model; pass --model")
    return data[0]["id"]


def _run_label(rate: float, cap: int | None) -> str:
    parts = [f"rate {rate:g} req/s" if math.isfinite(rate) else "rate inf"]
    if cap:
        parts.append(f"max concurrency {cap}")
    return ", ".join(parts)


async def _run_open(config: BenchConfig, target: Target, client: httpx.AsyncClient, workload, rate: float,
                    first: int) -> RunResult:
    """Poisson arrivals at `rate` (inf: at once), at most `max_concurrency` in flight; requests
    first, first + 1, … of the workload."""
    label = _run_label(rate, config.max_concurrency)
    progress = Progress(f"{config.label or workload.name} {label}", config.num_requests, config.progress)
    slots = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    t0, started = time.perf_counter(), time.time()

    async def one(index: int, at: float) -> RequestRecord:
        try:
            rec = await send(client, target, workload.request(first + index), t0, at)
        finally:
            if slots:
                slots.release()
        progress.update(rec.ok)
        return rec

    tasks: list[asyncio.Task] = []
    for index, at in zip(itertools.count(), poisson_offsets(rate, config.seed)):
        if config.num_requests is not None and index >= config.num_requests:
            break
        if config.duration_s is not None and at >= config.duration_s:
            break
        delay = at - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        if slots:
            await slots.acquire()  # a closed loop: wait for a request in flight to end
            if config.duration_s is not None and time.perf_counter() - t0 >= config.duration_s:
                slots.release()
                break
        tasks.append(asyncio.create_task(one(index, at)))
    records = list(await asyncio.gather(*tasks))
    progress.close()
    duration = time.perf_counter() - t0
    return RunResult(label, rate, config.max_concurrency, duration, records, summarize(records, duration, config.slo),
                     started_unix_s=started)


async def _run_interference(config: BenchConfig, target: Target, client: httpx.AsyncClient, chat: Workload,
                            long: Workload, with_long: bool, first_chat: int) -> RunResult:
    """`max_concurrency` chat streams back to back for `duration_s`; long prompts at fixed intervals."""
    label = "with long prompts" if with_long else "baseline"
    progress = Progress(f"{config.label or 'interference'} {label}", None, config.progress)
    window = config.duration_s
    records: list[RequestRecord] = []
    next_chat = itertools.count(first_chat)
    t0, started = time.perf_counter(), time.time()

    async def chat_stream() -> None:
        while time.perf_counter() - t0 < window:
            rec = await send(client, target, chat.request(next(next_chat)), t0, time.perf_counter() - t0)
            records.append(rec)
            progress.update(rec.ok)

    async def long_prompt(k: int, at: float) -> None:
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
        rec = await send(client, target, long.request(k), t0, at)
        records.append(rec)
        progress.update(rec.ok)

    arrivals = []
    if with_long and config.long_interval_s > 0:
        arrivals = list(itertools.takewhile(lambda at: at < window,
                                            (config.warmup_s + k * config.long_interval_s for k in itertools.count())))
    await asyncio.gather(*(chat_stream() for _ in range(config.max_concurrency)),
                         *(long_prompt(k, at) for k, at in enumerate(arrivals)))
    progress.close()
    duration = time.perf_counter() - t0
    records.sort(key=lambda r: (r.kind, r.index))
    long_sent = sorted(r.sent_s for r in records if r.kind == "long")
    summary = summarize(records, duration, config.slo, itl_from_s=config.warmup_s)
    return RunResult(label, math.inf, config.max_concurrency, duration, records, summary, long_sent, config.warmup_s,
                     started)
