"""Records → the numbers a serving benchmark reports (names as in vLLM's benchmark_serving).

    TTFT   first text chunk − send                         per completed request
    TPOT   (E2EL − TTFT) / (output tokens − 1)             per completed request with ≥ 2 tokens
    ITL    gap between consecutive text chunks of a stream  every gap of every completed request
    E2EL   end of stream − send                             per completed request
    throughput   completed requests, their output tokens, their prompt + output tokens ÷ duration
    goodput      completed requests meeting every given SLO ÷ duration; attainment = good ÷ sent

Latencies are reported in ms as mean / p50 / p90 / p99 / min / max (percentiles by linear
interpolation, like numpy's default); a distribution with no values is None, not NaN, so the JSON
stays valid. Accounting: every sent request is either completed or failed, and each failure has one
status (client.STATUSES); `check_accounting` asserts it.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from services.bench.client import STATUSES, RequestRecord

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class SLO:
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    @property
    def given(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None

    def met_by(self, rec: RequestRecord) -> bool:
        """Completed and within every given limit (a 1-token answer has no TPOT and cannot miss it)."""
        if not rec.ok:
            return False
        if self.ttft_ms is not None and (rec.ttft_s is None or rec.ttft_s * 1e3 > self.ttft_ms):
            return False
        tpot = rec.tpot_s
        return self.tpot_ms is None or tpot is None or tpot * 1e3 <= self.tpot_ms


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0–100) by linear interpolation between closest ranks."""
    if not values:
        raise ValueError("percentile of no values")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def distribution(values_s: Iterable[float]) -> dict[str, float] | None:
    """Seconds in → a summary in milliseconds (None when there are no values)."""
    ms = [v * 1e3 for v in values_s]
    if not ms:
        return None
    out = {"n": len(ms), "mean": sum(ms) / len(ms), "min": min(ms)}
    out |= {f"p{q}": percentile(ms, q) for q in PERCENTILES}
    out["max"] = max(ms)
    return out


def itls_after(rec: RequestRecord, from_s: float | None) -> list[float]:
    """The record's inter-token gaps, only those ending at or after `from_s` (run time) if given."""
    t = rec.token_times_s
    return [b - a for a, b in zip(t, t[1:]) if from_s is None or b >= from_s]


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: SLO = SLO(),
              itl_from_s: float | None = None, by_kind: bool = True) -> dict[str, Any]:
    done = [r for r in records if r.ok]
    failures = Counter(r.status for r in records if not r.ok)
    duration = max(duration_s, 1e-9)
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens for r in done)
    summary: dict[str, Any] = {
        "sent": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "failures": {status: failures[status] for status in STATUSES if failures[status]},
        "duration_s": duration_s,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "output_tokens_of_failed": sum(r.output_tokens for r in records if not r.ok),
        "request_throughput": len(done) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_ms": distribution(r.ttft_s for r in done if r.ttft_s is not None),
        "tpot_ms": distribution(r.tpot_s for r in done if r.tpot_s is not None),
        "itl_ms": distribution(x for r in done for x in itls_after(r, itl_from_s)),
        "e2el_ms": distribution(r.e2el_s for r in done),
        "goodput": None,
        # prompt tokens the server found in its prefix cache (None: it does not say)
        "prefix_hit_rate": (sum(r.cached_tokens for r in done) / max(1, in_tokens)
                            if done and all(r.cached_tokens is not None for r in done) else None),
    }
    if slo.given:
        good = sum(1 for r in records if slo.met_by(r))
        summary["goodput"] = {"slo_ttft_ms": slo.ttft_ms, "slo_tpot_ms": slo.tpot_ms, "good": good,
                              "request_goodput": good / duration,
                              "attainment_pct": 100.0 * good / len(records) if records else None}
    kinds = sorted({r.kind for r in records})
    if by_kind and len(kinds) > 1:
        summary["by_kind"] = {k: summarize([r for r in records if r.kind == k], duration_s, slo, itl_from_s, False)
                              for k in kinds}
    check_accounting(summary)
    return summary


def check_accounting(summary: dict[str, Any]) -> None:
    """Every request sent is completed or failed, and every failure is counted under one status."""
    if summary["completed"] + summary["failed"] != summary["sent"] or sum(summary["failures"].values()) != summary["failed"]:
        raise AssertionError(f"benchmark accounting is off: {summary['sent']} sent, {summary['completed']} completed, "
                             f"{summary['failed']} failed, failures {summary['failures']}")
