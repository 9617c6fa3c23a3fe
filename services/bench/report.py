"""The text summary printed at the end (laid out like vLLM's benchmark_serving) and the JSON file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from services.bench.runner import BenchResult, RunResult

WIDTH = 60
MAX_LISTED_FAILURES = 20


def _row(name: str, value: Any, fmt: str = "{:.2f}") -> str:
    text = "n/a" if value is None else fmt.format(value)
    return f"{name:<40}{text:>{WIDTH - 40}}"


def _title(text: str, fill: str = "-") -> str:
    return f"{' ' + text + ' ':{fill}^{WIDTH}}"


def format_summary(summary: dict[str, Any]) -> list[str]:
    lines = [
        _row("Requests sent:", summary["sent"], "{}"),
        _row("Completed:", summary["completed"], "{}"),
        _row("Failed:", summary["failed"], "{}"),
    ]
    lines += [_row(f"  {status}:", n, "{}") for status, n in summary["failures"].items()]
    lines += [
        _row("Duration (s):", summary["duration_s"]),
        _row("Total input tokens:", summary["total_input_tokens"], "{}"),
        _row("Total output tokens:", summary["total_output_tokens"], "{}"),
        _row("Request throughput (req/s):", summary["request_throughput"]),
        _row("Output token throughput (tok/s):", summary["output_throughput"]),
        _row("Total token throughput (tok/s):", summary["total_token_throughput"]),
    ]
    if summary.get("prefix_hit_rate") is not None:
        lines.append(_row("Prefix cache hit rate (%):", 100.0 * summary["prefix_hit_rate"]))
    good = summary.get("goodput")
    if good:
        slos = ", ".join(f"{name} <= {good[key]:g} ms" for name, key in (("TTFT", "slo_ttft_ms"), ("TPOT", "slo_tpot_ms"))
                         if good[key] is not None)
        lines += [f"SLOs: {slos}", _row("Goodput (req/s):", good["request_goodput"]),
                  _row("SLO attainment (%):", good["attainment_pct"])]
    for key, name in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                      ("itl_ms", "Inter-token Latency"), ("e2el_ms", "End-to-end Latency")):
        short = key.split("_")[0].upper()
        lines.append(_title(name))
        dist = summary.get(key)
        lines += [_row(f"Mean {short} (ms):", dist and dist["mean"])]
        lines += [_row(f"P{q} {short} (ms):", dist and dist[f"p{q}"]) for q in (50, 90, 99)]
        lines += [_row(f"Max {short} (ms):", dist and dist["max"])]
    return lines


def format_run(run: RunResult) -> list[str]:
    lines = [_title(f"Serving benchmark: {run.label}", "=")]
    lines += format_summary(run.summary)
    for kind, sub in run.summary.get("by_kind", {}).items():
        itl, ttft = sub.get("itl_ms"), sub.get("ttft_ms")
        lines.append(_title(f"{kind} requests only"))
        lines += [_row("Sent / completed / failed:", f"{sub['sent']} / {sub['completed']} / {sub['failed']}", "{}"),
                  _row(f"{kind} TTFT p50 / p99 (ms):", ttft and f"{ttft['p50']:.1f} / {ttft['p99']:.1f}", "{}"),
                  _row(f"{kind} ITL p50 / p99 (ms):", itl and f"{itl['p50']:.1f} / {itl['p99']:.1f}", "{}")]
    if run.itl_from_s:
        lines.append(f"(ITLs counted from t = {run.itl_from_s:g} s on)")
    if run.long_arrivals_s:
        lines.append("Long prompts sent at (s): " + ", ".join(f"{t:.1f}" for t in run.long_arrivals_s))
    failed = [r for r in run.records if not r.ok]
    if failed:
        lines.append(_title("Failed requests"))
        for r in failed[:MAX_LISTED_FAILURES]:
            lines.append(f"  #{r.index} ({r.kind}) {r.status}: {r.error[:100]}")
        if len(failed) > MAX_LISTED_FAILURES:
            lines.append(f"  ... and {len(failed) - MAX_LISTED_FAILURES} more (all are in the JSON)")
    lines.append("=" * WIDTH)
    return lines


def format_result(result: BenchResult) -> str:
    cfg = result.config
    head = [f"pdserve bench: {cfg.base_url} model {result.model}, {cfg.dataset or cfg.workload} workload, "
            f"/v1/{'chat/completions' if cfg.endpoint == 'chat' else 'completions'}, seed {cfg.seed}"]
    lines = head + [line for run in result.runs for line in format_run(run)]
    if len(result.runs) > 1 and not cfg.interference:
        lines += ["", _title("Sweep"), f"{'run':<36}{'req/s':>8}{'out tok/s':>10}{'goodput':>8}"]
        for run in result.runs:
            s = run.summary
            good = s["goodput"]["request_goodput"] if s.get("goodput") else None
            lines.append(f"{run.label:<36}{s['request_throughput']:>8.2f}{s['output_throughput']:>10.1f}"
                         f"{'n/a' if good is None else f'{good:.2f}':>8}")
    ratio = result.interference
    if ratio:
        r = "n/a" if ratio["ratio"] is None else f"{ratio['ratio']:.2f}"
        lines += ["", f"Chat streams' ITL p99: {ratio['chat_itl_p99_ms_with_long']:.1f} ms with long prompts arriving, "
                      f"{ratio['chat_itl_p99_ms_baseline']:.1f} ms without: ratio {r}"]
    return "\n".join(lines)


def write_json(result: BenchResult, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result.to_json(), indent=1, allow_nan=False))
