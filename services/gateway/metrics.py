"""The gateway's /metrics: its own latency histograms, plus every worker's gauges and counters
re-exported from the WorkerStats they publish (DESIGN.md: the gateway's /metrics is the one place to
look). Metric names are a contract (DESIGN.md "Contracts"); each app owns its CollectorRegistry.

Worker rows are labelled service=<role>, instance=<inst>; the gateway's own in-flight counts appear
as service="gateway". Prefix-cache counters are cumulative on the worker side, so they are exported
as counters whose value is the latest reported total (a custom collector, not Counter.inc()).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.gateway.cost import Price
from shared.protocol.messages import Timing, Usage, WorkerStats
from shared.telemetry.names import (COST, DECODE_CORE_SECONDS, DECODE_SECONDS, E2E, ENGINE_BUSY, ENGINE_BUSY_CORE,
                                    GENAI_DURATION, GENAI_DURATION_BUCKETS, GENAI_TPOT, GENAI_TPOT_BUCKETS, GENAI_TTFT,
                                    GENAI_TTFT_BUCKETS, GENERATION_TOKENS, ITL, KV_BLOCKS_IN_USE, KV_TRANSFER,
                                    KV_TRANSFER_BYTES, MIGRATIONS, ROUTER_CACHED_TOKENS, ROUTER_JOBS, PREFILL_CORE_SECONDS, PREFILL_SECONDS, PREFIX_HITS,
                                    PREFIX_QUERIES, PROMPT_TOKENS, REQUESTS_RUNNING, REQUESTS_TOTAL, REQUESTS_WAITING,
                                    SPEC_ACCEPTED_PER_POS, SPEC_ACCEPTED_TOKENS, SPEC_DRAFT_TOKENS, SPEC_DRAFTS, TTFT)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LABELS = ["service", "instance"]


class _LiveCollector(Collector):
    """Gauges and counters read at scrape time: the gateway's own counts and workers' latest stats."""

    def __init__(self, instance: str, gateway_counts: Callable[[], tuple[int, int]],
                 worker_stats: Callable[[], Iterable[WorkerStats]]) -> None:
        self._instance = instance
        self._gateway_counts = gateway_counts
        self._worker_stats = worker_stats

    def describe(self) -> Iterable[Metric]:
        return self._families()

    def collect(self) -> Iterable[Metric]:
        running, waiting, blocks, queries, hits, drafts, draft_tokens, accepted, per_pos, busy, busy_core = \
            self._families()
        in_flight, awaiting = self._gateway_counts()
        running.add_metric(["gateway", self._instance], in_flight)
        waiting.add_metric(["gateway", self._instance], awaiting)
        for s in self._worker_stats():
            labels = [s.role, s.instance]
            running.add_metric(labels, s.running)
            waiting.add_metric(labels, s.waiting)
            blocks.add_metric(labels, s.kv_blocks_in_use)
            queries.add_metric(labels, s.prefix_queries)
            hits.add_metric(labels, s.prefix_hits)
            if s.role != "kvstore":
                busy.add_metric(labels, s.busy_s)
                busy_core.add_metric(labels, s.busy_core_s)
            if s.role in ("decode", "colocated"):
                drafts.add_metric(labels, s.spec_drafts)
                draft_tokens.add_metric(labels, s.spec_draft_tokens)
                accepted.add_metric(labels, s.spec_accepted_tokens)
                for pos, n in enumerate(s.spec_accepted_per_pos):
                    per_pos.add_metric(labels + [str(pos)], n)
        return [running, waiting, blocks, queries, hits, drafts, draft_tokens, accepted, per_pos, busy, busy_core]

    @staticmethod
    def _families() -> list[Metric]:
        return [
            GaugeMetricFamily(REQUESTS_RUNNING, "Requests in flight (gateway: admitted and not yet answered)",
                              labels=_LABELS),
            GaugeMetricFamily(REQUESTS_WAITING, "Requests waiting (gateway: dispatched, no token yet)",
                              labels=_LABELS),
            GaugeMetricFamily(KV_BLOCKS_IN_USE, "KV cache blocks in use", labels=_LABELS),
            CounterMetricFamily(PREFIX_QUERIES, "Prefix cache block lookups (cumulative, as reported)",
                                labels=_LABELS),
            CounterMetricFamily(PREFIX_HITS, "Prefix cache block hits (cumulative, as reported)", labels=_LABELS),
            CounterMetricFamily(SPEC_DRAFTS, "Speculative decoding: sequence-steps that verified proposals",
                                labels=_LABELS),
            CounterMetricFamily(SPEC_DRAFT_TOKENS, "Speculative decoding: proposed tokens verified", labels=_LABELS),
            CounterMetricFamily(SPEC_ACCEPTED_TOKENS, "Speculative decoding: proposed tokens accepted",
                                labels=_LABELS),
            CounterMetricFamily(SPEC_ACCEPTED_PER_POS, "Speculative decoding: drafts whose proposal at this "
                                "position was accepted", labels=_LABELS + ["position"]),
            CounterMetricFamily(ENGINE_BUSY, "Engine step time (cumulative, as reported); all of it is charged "
                                "to requests as prefill or decode seconds", labels=_LABELS),
            CounterMetricFamily(ENGINE_BUSY_CORE, "Engine step time times the threads each step ran on "
                                "(cumulative, as reported)", labels=_LABELS),
        ]


class GatewayMetrics:
    def __init__(self, instance: str, gateway_counts: Callable[[], tuple[int, int]],
                 worker_stats: Callable[[], Iterable[WorkerStats]], *, model: str = "", price: Price = Price()
                 ) -> None:
        self.registry = CollectorRegistry()
        self.model, self.price = model, price
        r = self.registry
        self.ttft = Histogram(TTFT, "Time from request arrival to the first token, seconds", registry=r,
                              buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80))
        self.itl = Histogram(ITL, "Time between consecutive output tokens, seconds", registry=r,
                             buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5))
        self.e2e = Histogram(E2E, "Time from request arrival to its last token, seconds", registry=r,
                             buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 600))
        self.kv_transfer = Histogram(KV_TRANSFER, "KV cache write (prefill) + read (decode) time per request, seconds",
                                     registry=r, buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                                                          0.25, 0.5, 1, 2.5))
        self.requests = Counter(REQUESTS_TOTAL, "Requests by outcome", ["status"], registry=r)
        self.migrations = Counter(MIGRATIONS, "Requests resubmitted after their worker died or hung (each "
                                  "resubmission)", registry=r)
        self.router_jobs = Counter(ROUTER_JOBS, "Jobs by where the router sent them (pool; worker, empty for "
                                   "the shared queue) and why", ["pool", "worker", "reason"], registry=r)
        self.router_cached = Counter(ROUTER_CACHED_TOKENS, "Prompt tokens the router expected to be cached where "
                                     "it sent each job", ["pool"], registry=r)
        self.prompt_tokens = Counter(PROMPT_TOKENS, "Prompt tokens of finished requests (each choice's)", registry=r)
        self.generation_tokens = Counter(GENERATION_TOKENS, "Tokens generated by finished requests", registry=r)
        self.prefill_seconds = Counter(PREFILL_SECONDS, "Engine time charged to prompt chunks, seconds", registry=r)
        self.decode_seconds = Counter(DECODE_SECONDS, "Engine time charged to decode rows, seconds", registry=r)
        self.prefill_core_seconds = Counter(PREFILL_CORE_SECONDS, "Prefill seconds times the threads of each "
                                            "step (GPU: the device), what --price charges", registry=r)
        self.decode_core_seconds = Counter(DECODE_CORE_SECONDS, "Decode seconds times the threads of each step",
                                           registry=r)
        self.kv_bytes = Counter(KV_TRANSFER_BYTES, "KV cache bytes moved (prefill → kvstore → engines)", registry=r)
        self.cost = Counter(COST, "Price of the work done (--price), by phase", ["phase", "currency"], registry=r)
        genai = ["gen_ai_operation_name", "gen_ai_request_model"]
        self.genai_ttft = Histogram(GENAI_TTFT, "GenAI: time to generate the first token, seconds", genai,
                                    registry=r, buckets=GENAI_TTFT_BUCKETS)
        self.genai_tpot = Histogram(GENAI_TPOT, "GenAI: time per output token after the first, seconds", genai,
                                    registry=r, buckets=GENAI_TPOT_BUCKETS)
        self.genai_duration = Histogram(GENAI_DURATION, "GenAI: time to last byte, seconds", genai, registry=r,
                                        buckets=GENAI_DURATION_BUCKETS)
        r.register(_LiveCollector(instance, gateway_counts, worker_stats))

    def route(self, route) -> None:
        self.router_jobs.labels(pool=route.pool, worker=route.target, reason=route.reason).inc()
        self.router_cached.labels(pool=route.pool).inc(route.cached_tokens)

    def count(self, status: str) -> None:
        self.requests.labels(status=status).inc()

    def account(self, timing: Timing, usage: Usage) -> None:
        """A finished request's (one choice's) tokens, compute, KV moved and their price."""
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.generation_tokens.inc(usage.completion_tokens)
        kv_bytes = timing.kv_bytes_written + timing.kv_bytes_read
        self.prefill_seconds.inc(timing.prefill_compute_s)
        self.decode_seconds.inc(timing.decode_compute_s)
        self.prefill_core_seconds.inc(timing.prefill_core_s)
        self.decode_core_seconds.inc(timing.decode_core_s)
        self.kv_bytes.inc(kv_bytes)
        for phase, amount in self.price.charge(timing.prefill_core_s, timing.decode_core_s, kv_bytes).items():
            if phase != "total":
                self.cost.labels(phase=phase, currency=self.price.currency).inc(amount)

    def observe_genai(self, operation: str, ttft_s: float | None, duration_s: float, output_tokens: int) -> None:
        labels = {"gen_ai_operation_name": operation, "gen_ai_request_model": self.model}
        self.genai_duration.labels(**labels).observe(duration_s)
        if ttft_s is not None:
            self.genai_ttft.labels(**labels).observe(ttft_s)
            if output_tokens > 1:
                self.genai_tpot.labels(**labels).observe((duration_s - ttft_s) / (output_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
