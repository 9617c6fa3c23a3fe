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

from shared.protocol.messages import WorkerStats
from shared.telemetry.names import (E2E, ITL, KV_BLOCKS_IN_USE, KV_TRANSFER, PREFIX_HITS, PREFIX_QUERIES,
                                    REQUESTS_RUNNING, REQUESTS_TOTAL, REQUESTS_WAITING, SPEC_ACCEPTED_PER_POS,
                                    SPEC_ACCEPTED_TOKENS, SPEC_DRAFT_TOKENS, SPEC_DRAFTS, TTFT)

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
        running, waiting, blocks, queries, hits, drafts, draft_tokens, accepted, per_pos = self._families()
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
            if s.role in ("decode", "colocated"):
                drafts.add_metric(labels, s.spec_drafts)
                draft_tokens.add_metric(labels, s.spec_draft_tokens)
                accepted.add_metric(labels, s.spec_accepted_tokens)
                for pos, n in enumerate(s.spec_accepted_per_pos):
                    per_pos.add_metric(labels + [str(pos)], n)
        return [running, waiting, blocks, queries, hits, drafts, draft_tokens, accepted, per_pos]

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
        ]


class GatewayMetrics:
    def __init__(self, instance: str, gateway_counts: Callable[[], tuple[int, int]],
                 worker_stats: Callable[[], Iterable[WorkerStats]]) -> None:
        self.registry = CollectorRegistry()
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
        r.register(_LiveCollector(instance, gateway_counts, worker_stats))

    def count(self, status: str) -> None:
        self.requests.labels(status=status).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
