"""PNG plots (matplotlib, Agg backend: no display needed). The plot functions take plain series, so
the comparison script draws several systems on one figure with them; `write_plots` draws one
`pdserve bench` result.

    latency_cdfs.png       CDFs of TTFT, ITL, E2EL, one line per series (`cdf`: one metric)
    itl_over_time.png      every ITL at its token's arrival time; long-prompt arrivals as vertical lines
    throughput_vs_rate.png output tok/s and goodput against the offered request rate (a sweep)
    `bars`                 grouped bars with their values (the comparison's per-system numbers)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

from services.bench.metrics import itls_after  # noqa: E402
from services.bench.runner import BenchResult, RunResult  # noqa: E402

DPI = 80


@dataclass
class ItlTrace:
    """One panel of an ITL-over-time plot."""

    label: str
    token_times_s: list[float]
    itls_ms: list[float]
    long_arrivals_s: list[float]


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def latency_cdfs(series: dict[str, dict[str, Sequence[float]]], path: Path, title: str = "") -> Path:
    """series: label → {"TTFT": ms values, "ITL": …, "E2EL": …}."""
    metrics = ("TTFT", "ITL", "E2EL")
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    for ax, metric in zip(axes, metrics):
        for label, values in series.items():
            xs = sorted(values.get(metric, ()))
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label, lw=1.3, drawstyle="steps-post")
        ax.set_xscale("log")
        ax.set_xlabel(f"{metric} (ms, log)")
        ax.set_ylabel("fraction ≤ x")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def cdf(series: dict[str, Sequence[float]], path: Path, xlabel: str, title: str = "",
        styles: dict[str, dict] | None = None, ymin: float = 0.0) -> Path:
    """One metric's CDF, one line per series (log x); `styles`: matplotlib line options per label;
    `ymin` > 0 zooms into the tail."""
    fig, ax = plt.subplots(figsize=(9, 3.6))
    left = []  # where each line enters the shown range
    for label, values in series.items():
        xs = sorted(values)
        if xs:
            style = {"lw": 1.3} | (styles or {}).get(label, {})
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label, drawstyle="steps-post", **style)
            left.append(xs[min(len(xs) - 1, int(ymin * len(xs)))])
    ax.set_xscale("log")
    if left and min(left) > 0:
        ax.set_xlim(left=0.8 * min(left))
    ax.set_ylim(ymin, 1.005)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction ≤ x")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    if title:
        ax.set_title(title, fontsize=10)
    return _save(fig, path)


def bars(groups: dict[str, dict[str, float | None]], path: Path, ylabel: str, title: str = "",
         log: bool = False) -> Path:
    """Grouped bars: groups (x positions, e.g. systems) × series (bars within a group), values labelled."""
    series = list(dict.fromkeys(name for values in groups.values() for name in values))
    width = 0.8 / max(1, len(series))
    fig, ax = plt.subplots(figsize=(1.6 + 1.5 * len(groups), 3.4))
    for j, name in enumerate(series):
        xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(groups))]
        ys = [values.get(name) or 0.0 for values in groups.values()]
        rects = ax.bar(xs, ys, width, label=name if len(series) > 1 else None)
        ax.bar_label(rects, labels=[_short(y) for y in ys], fontsize=7)
    ax.set_xticks(range(len(groups)), list(groups), fontsize=8)
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    ax.grid(alpha=0.3, axis="y")
    if len(series) > 1:
        ax.legend(fontsize=7)
    if title:
        ax.set_title(title, fontsize=10)
    return _save(fig, path)


def _short(y: float) -> str:
    return "n/a" if not y else (f"{y:,.0f}" if y >= 100 else f"{y:.3g}")


def itl_over_time(traces: Sequence[ItlTrace], path: Path, title: str = "") -> Path:
    fig, axes = plt.subplots(len(traces), 1, figsize=(10, 1.9 * len(traces) + 0.6), sharex=True, squeeze=False)
    top = max((max(t.itls_ms) for t in traces if t.itls_ms), default=1.0)
    for ax, trace in zip(axes[:, 0], traces):
        ax.scatter(trace.token_times_s, trace.itls_ms, s=2, alpha=0.5)
        for i, at in enumerate(trace.long_arrivals_s):
            ax.axvline(at, color="tab:red", lw=0.8, ls="--", label="long prompt sent" if i == 0 else None)
        ax.set_yscale("log")
        ax.set_ylim(1, top * 1.5)
        ax.set_ylabel("ITL (ms)")
        ax.set_title(trace.label, fontsize=9, loc="left")
        ax.grid(alpha=0.3)
        if trace.long_arrivals_s:
            ax.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("time since the run started (s)")
    if title:
        fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def throughput_vs_rate(series: dict[str, Sequence[tuple[float, float, float | None]]], path: Path,
                       title: str = "") -> Path:
    """series: label → [(offered req/s, output tok/s, goodput req/s or None)]."""
    has_goodput = any(g is not None for points in series.values() for _, _, g in points)
    fig, axes = plt.subplots(1, 2 if has_goodput else 1, figsize=(10 if has_goodput else 5.5, 3.4), squeeze=False)
    for label, points in series.items():
        points = sorted(points)
        axes[0, 0].plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
        if has_goodput:
            axes[0, 1].plot([p[0] for p in points], [p[2] or 0.0 for p in points], marker="o", label=label)
    axes[0, 0].set_ylabel("output tokens/s")
    if has_goodput:
        axes[0, 1].set_ylabel("goodput (req/s meeting the SLOs)")
    for ax in axes[0]:
        ax.set_xlabel("offered request rate (req/s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def run_latencies(run: RunResult, kind: str | None = None) -> dict[str, list[float]]:
    """A run's completed requests (of one kind, if given) as ms values for `latency_cdfs`."""
    recs = [r for r in run.records if r.ok and (kind is None or r.kind == kind)]
    return {"TTFT": [r.ttft_s * 1e3 for r in recs if r.ttft_s is not None],
            "ITL": [x * 1e3 for r in recs for x in itls_after(r, run.itl_from_s)],
            "E2EL": [r.e2el_s * 1e3 for r in recs]}


def run_itl_trace(run: RunResult, label: str, kind: str | None = None) -> ItlTrace:
    times, itls = [], []
    for r in run.records:
        if r.ok and (kind is None or r.kind == kind):
            t = r.token_times_s
            times += t[1:]
            itls += [(b - a) * 1e3 for a, b in zip(t, t[1:])]
    return ItlTrace(label, times, itls, run.long_arrivals_s)


def write_plots(result: BenchResult, out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    runs = result.runs
    kind = "chat" if result.config.interference else None
    written = [latency_cdfs({r.label: run_latencies(r) for r in runs}, out / "latency_cdfs.png",
                            f"{result.model}: {result.config.dataset or result.config.workload}")]
    traces = [run_itl_trace(r, r.label + (" (chat streams)" if kind else ""), kind) for r in runs]
    written.append(itl_over_time(traces, out / "itl_over_time.png"))
    rates = [r for r in runs if math.isfinite(r.request_rate)]
    if len(rates) > 1:
        points = [(r.request_rate, r.summary["output_throughput"],
                   r.summary["goodput"]["request_goodput"] if r.summary.get("goodput") else None) for r in rates]
        written.append(throughput_vs_rate({result.model: points}, out / "throughput_vs_rate.png"))
    return written

