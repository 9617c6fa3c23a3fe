"""bench_compare.py's report: compare.md (tables of absolute numbers and ratios, whether each goal
was met, contention and failures), compare.json (the same numbers, every pass), and the PNG plots."""

from __future__ import annotations

import json
import os
import platform
import statistics
from pathlib import Path

from compare_systems import LLAMA_CTX_PER_SLOT, LLAMA_SLOTS

from services.bench.metrics import SLO
from services.bench.plots import bars, cdf, itl_over_time, latency_cdfs, run_itl_trace, run_latencies, throughput_vs_rate
from services.bench.runner import BenchResult

COLOCATED = ("coloc", "coloc-nochunk", "llama")  # every system that prefills and decodes on the same cores


def _med(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _f(x, fmt: str = "{:.1f}") -> str:
    return "n/a" if x is None else fmt.format(x)


def _ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def _goal(ok: bool | None) -> str:
    return "n/a" if ok is None else ("**met**" if ok else "**not met**")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


class Report:
    def __init__(self, meta, systems, results, roofline, slo: SLO | None, slo_reference: str | None):
        self.meta, self.systems, self.results, self.roofline = meta, systems, results, roofline
        self.slo, self.slo_reference = slo, slo_reference
        self.lines: list[str] = []

    def entries(self, key: str, measurement: str) -> list[dict]:
        return self.results.get(key, {}).get(measurement, [])

    def title(self, key: str) -> str:
        return self.systems.get(key, {}).get("title", key)

    def add(self, *lines: str) -> None:
        self.lines += lines

    # ------------------------------------------------------------------------------------ sections

    def header(self) -> None:
        m, r = self.meta, self.roofline
        bw = ", ".join(f"{p['bandwidth_GBps']:.1f} GB/s {p['when']}" for p in r["probes"])
        self.add("# pdserve vs llama.cpp: serving comparison", "",
                 f"command: `{m['command']}` ({'quick smoke run' if m['quick'] else 'full run'}), started "
                 f"{m['started']}, {m['wall_s'] / 60:.1f} min. Results come from this run only.", "",
                 f"Machine: {_cpu_model()}, {os.cpu_count()} cores. Memory read bandwidth (1 GiB fp32 sum, best of "
                 f"5, no server running): {bw}.",
                 f"Model: `{Path(m['model']).name}` ({m['model_bytes'] / 1e6:.1f} MB), the same file for every system. "
                 f"Workloads: `pdserve bench`'s seeded traces (seed {m['seed']}), identical for every system; "
                 "every request streams over HTTP `/v1/completions` with `ignore_eos` and temperature 0.", "",
                 "| key | system | started as | cores |", "|---|---|---|---|")
        for key, s in self.systems.items():
            self.add(f"| {key} | {s['title']} | `{s['command']}` | {s['threads']} |")
        self.add("", f"llama-server: `-np {LLAMA_SLOTS} -c {LLAMA_SLOTS * LLAMA_CTX_PER_SLOT}` "
                     f"({LLAMA_CTX_PER_SLOT} tokens per slot, no unified KV: that is only the default with automatic "
                     "slots), continuous batching on (`-cb`, the build's default), prompt cache on (`--cache-prompt` "
                     "default: a slot keeps its last prompt's KV and reuses the common prefix; `--cache-ram` 8192 MiB "
                     "default: prompts are also saved to and restored from host memory; `--cache-reuse 0`: no KV "
                     "shifting; slots picked by prompt similarity ≥ 0.10, else least recently used), logical batch "
                     "2048 / physical 512 (defaults: a long prompt is prefilled in one `llama_decode` call). "
                     + (" Run with `--no-repack`: on this CPU llama.cpp's default (weights repacked for its AMX "
                    "kernels) crashed on every prompt batch." if m.get("llama_no_repack") else "")
                 + " pdserve: the default configuration (the file's Q4_1/Q8_0 blocks, fp32 activations, the fused "
                   "C++ forward, bf16 KV, suffix speculation), its own NATS + Valkey per stack.", "",
                 "Order: " + "; ".join(f"{k}: {' '.join(v)}" for k, v in m["order"].items())
                 + " (then the cache-off systems for d). Within a system, pass 1 measures the interference "
                   "baseline first, pass 2 the long-prompt phase first.", "")

    def interference(self) -> None:
        s = self.meta["settings"]
        self.add("## a. Interference: chat streams' ITL p99 while long prompts arrive", "",
                 f"{s['streams']} chat streams back to back (closed loop) for {s['window_s']:g} s; long-doc prompts "
                 f"({_range(s['long_input'], '1500-3000')} tokens, {_range(s['long_output'], '32-128')} out) sent at "
                 f"{s['warmup_s']:g} s and every {s['long_interval_s']:g} s after; chat ITLs counted from "
                 f"{s['warmup_s']:g} s on, until every request has ended. Ratio = with ÷ without, per pass. "
                 "When the stalls are fewer than 1% of the ITLs (a few whole-prompt prefills), p99 does not see "
                 "them: the max column does.", "",
                 "| system | ITL p99 without (ms) | ITL p99 with (ms) | ratio per pass | **ratio (median)** | "
                 "ITL p50 without / with (ms) | ITL max without / with (ms) | long-prompt TTFT p50 (s) | "
                 "long prompts sent |", "|---|---|---|---|---|---|---|---|---|")
        ratios = {}
        for key in self.systems:
            es = self.entries(key, "interference")
            if not es:
                continue
            ratios[key] = _med(e["ratio"] for e in es)
            base = "/".join(_f(e["baseline"]["chat_itl_p99_ms"], "{:.0f}") for e in es)
            long = "/".join(_f(e["long"]["chat_itl_p99_ms"], "{:.0f}") for e in es)
            p50 = f"{_f(_med(e['baseline']['chat_itl_p50_ms'] for e in es))} / {_f(_med(e['long']['chat_itl_p50_ms'] for e in es))}"
            top = f"{_f(_med(e['baseline']['chat_itl_max_ms'] for e in es), '{:.0f}')} / " \
                  f"{_f(_med(e['long']['chat_itl_max_ms'] for e in es), '{:.0f}')}"
            long_ttft = _med(e["long"]["long_ttft_p50_ms"] for e in es)
            self.add(f"| {self.title(key)} | {base} | {long} | {' / '.join(_f(e['ratio'], '{:.2f}') for e in es)} | "
                     f"**{_f(ratios[key], '{:.2f}')}** | {p50} | {top} | {_f(long_ttft and long_ttft / 1e3, '{:.2f}')} | "
                     f"{'/'.join(str(len(e['long']['long_arrivals_s'])) for e in es)} |")
        d = ratios.get("disagg")
        others = [ratios[k] for k in COLOCATED if ratios.get(k) is not None]
        ok = None if d is None else (d <= 1.3 and all(d < o for o in others))
        self.add("", f"Goal: disaggregated ratio ≤ 1.3 and lower than every colocated system's: {_goal(ok)} "
                     f"(disaggregated {_f(d, '{:.2f}')}; colocated systems "
                     + ", ".join(f"{self.title(k)} {_f(ratios.get(k), '{:.2f}')}" for k in COLOCATED) + ").", "")

    def goodput(self) -> None:
        if self.slo is None:
            return
        ref = self.entries(self.slo_reference, "unloaded")[0]
        s = self.meta["settings"]
        self.add("## b. Goodput under TTFT and TPOT SLOs at rising request rates", "",
                 f"Unloaded latency (chat, one request at a time, {s['unloaded_output'][0]} output tokens), TTFT p50 / "
                 "TPOT p50 per system: " + "; ".join(
                     f"{self.title(k)} {_f(e[0]['ttft_p50_ms'], '{:.0f}')} / {_f(e[0]['tpot_p50_ms'])} ms"
                     for k in self.systems if (e := self.entries(k, "unloaded"))) + ".",
                 f"SLOs from **{self.title(self.slo_reference)}** (the first system measured), applied to all: "
                 f"TTFT ≤ {s['ttft_slo_x']:g} × {ref['ttft_p50_ms']:.0f} = **{self.slo.ttft_ms:.0f} ms**, "
                 f"TPOT ≤ {s['tpot_slo_x']:g} × {ref['tpot_p50_ms']:.1f} = **{self.slo.tpot_ms:.1f} ms**. "
                 f"Chat workload, {s['sweep_requests']} requests per rate, Poisson arrivals (same seed for all). "
                 "Cell: goodput req/s (SLO attainment) · output tok/s · TTFT p50 · TPOT p50.", "")
        keys = [k for k in self.systems if self.entries(k, "goodput")]
        self.add("| offered req/s | " + " | ".join(self.title(k) for k in keys) + " |", "|---" * (len(keys) + 1) + "|")
        for i, rate in enumerate(s["rates"]):
            cells = []
            for k in keys:
                p = self.entries(k, "goodput")[0]["rates"][i]
                cells.append(f"{p['goodput']:.2f} ({p['attainment_pct']:.0f}%) · {p['output_tok_s']:.0f} tok/s · "
                             f"{_f(p['ttft_p50_ms'], '{:.0f}')} ms · {_f(p['tpot_p50_ms'])} ms")
            self.add(f"| {rate:g} | " + " | ".join(cells) + " |")
        self.add("")

    def throughput(self) -> None:
        self.add("## c. Output-token throughput at max concurrency 16 (chat)", "",
                 "| system | output tok/s per pass | **median** | ÷ llama-server | TTFT p50 (ms) | TPOT p50 (ms) | "
                 "ITL p99 (ms) |", "|---|---|---|---|---|---|---|")
        med = {k: _med(e["output_tok_s"] for e in self.entries(k, "throughput_c16")) for k in self.systems}
        for k, es in ((k, self.entries(k, "throughput_c16")) for k in self.systems):
            if es:
                self.add(f"| {self.title(k)} | {' / '.join(_f(e['output_tok_s'], '{:.0f}') for e in es)} | "
                         f"**{_f(med[k], '{:.0f}')}** | {_f(_ratio(med[k], med.get('llama')), '{:.2f}')} | "
                         f"{_f(_med(e['ttft_p50_ms'] for e in es), '{:.0f}')} | {_f(_med(e['tpot_p50_ms'] for e in es))} | "
                         f"{_f(_med(e['itl_p99_ms'] for e in es), '{:.0f}')} |")
        best = max((med[k] or 0 for k in ("disagg", "coloc", "coloc-nochunk")), default=None)
        llama = med.get("llama")
        self.add("", f"Goal: pdserve ≥ llama-server: {_goal(None if not llama else best >= llama)} (best pdserve "
                     f"{_f(best, '{:.0f}')} vs {_f(llama, '{:.0f}')} tok/s).", "")

    def prefix(self) -> None:
        s = self.meta["settings"]
        self.add("## d. TTFT on a shared prefix, prefix cache on vs off", "",
                 "shared-prefix workload: one ~1,200-token prefix, distinct 20–60-token questions, "
                 f"{s['prefix_output'][0]} output tokens, one request at a time; request 0 fills the cache and is "
                 f"left out; TTFT over the next {s['prefix_requests']}. pdserve's on/off comparison is colocated; "
                 "disaggregated is measured 'on' only (to keep the run short).", "",
                 "| system | prompt tokens | TTFT p50 cache on (ms) | TTFT p50 cache off (ms) | **off ÷ on** | "
                 "cold TTFT, request 0 (ms) |", "|---|---|---|---|---|---|")
        pdserve_ratio = None
        for on, off in (("coloc", "coloc-noprefix"), ("llama", "llama-noprefix"), ("disagg", None)):
            e_on, e_off = self.entries(on, "prefix"), self.entries(off, "prefix") if off else []
            if not e_on:
                continue
            a = e_on[0]["ttft_p50_ms"]
            b = e_off[0]["ttft_p50_ms"] if e_off else None
            ratio = _ratio(b, a)
            self.add(f"| {self.title(on)} | {e_on[0]['prompt_tokens']:.0f} | {_f(a, '{:.0f}')} | {_f(b, '{:.0f}')} | "
                     f"**{_f(ratio, '{:.1f}×')}** | {_f(e_on[0]['cold_ttft_ms'], '{:.0f}')} |")
            if on == "coloc":
                pdserve_ratio = ratio
        ok = None if pdserve_ratio is None else pdserve_ratio >= 5
        self.add("", f"Goal: ≥ 5× lower TTFT p50 with the cache (pdserve): {_goal(ok)}.", "")

    def decode(self) -> None:
        r = self.roofline
        bw = max(p["bandwidth_GBps"] for p in r["probes"]) * 1e9
        kv_values = r["kv_values_per_token"]
        weights = {"llama": r["llama_weight_bytes"]}
        self.add("## e. Decode at batch 1, tokens/s and MBU", "",
                 f"One request at a time, ~100-token prompt, {self.meta['settings']['decode_output']} output tokens; "
                 "tok/s = 1000 / TPOT (through HTTP streaming). MBU = (weight bytes + KV bytes read per step) × tok/s ÷ "
                 f"{bw / 1e9:.1f} GB/s (the best read bandwidth measured in this run; lower readings are other "
                 "tenants'). Weight bytes: "
                 f"llama.cpp reads the GGUF's tensors as stored ({r['llama_weight_bytes'] / 1e6:.1f} MB, Q4_1 + the "
                 f"Q8_0 tied embedding/output head); pdserve reads the same blocks ({r['pdserve_weight_bytes_b1'] / 1e6:.1f} MB, "
                 "bench_model.decode_weight_bytes). KV: 11,520 values/token × 2 bytes (bf16 / f16) × mean context. "
                 "pdserve speculates (suffix, its default), so a step can yield more than one token and its MBU here is "
                 "an upper bound; bench_model.py measures MBU per step with speculation off.", "",
                 "| system | cores for decode | TPOT (ms) | **tok/s** | ÷ llama-server | weights + KV per step (MB) | "
                 "**MBU** |", "|---|---|---|---|---|---|---|")
        llama_tok = _med(e["tok_s"] for e in self.entries("llama", "decode_b1"))
        for k in self.systems:
            es = self.entries(k, "decode_b1")
            if not es:
                continue
            tok = _med(e["tok_s"] for e in es)
            ctx = _med(e["mean_context"] for e in es) or 0
            step = weights.get(k, r["pdserve_weight_bytes_b1"]) + ctx * kv_values * 2
            mbu = step * tok / bw if tok else None
            cores = "1 (decode worker)" if k == "disagg" else "2"
            self.add(f"| {self.title(k)} | {cores} | {_f(_med(e['tpot_ms'] for e in es), '{:.2f}')} | "
                     f"**{_f(tok)}** | {_f(_ratio(tok, llama_tok), '{:.2f}')} | {step / 1e6:.1f} | "
                     f"**{_f(mbu and 100 * mbu, '{:.0f}%')}** |")
        self.add("")

    def noise(self) -> None:
        self.add("## Noise, contention, failures", "",
                 "Cores used by other processes (not the system under test, not this client) while each measurement "
                 "ran, from /proc/stat (max over passes):", "",
                 "| system | " + " | ".join(MEASUREMENTS) + " |", "|---" * (len(MEASUREMENTS) + 1) + "|")
        for k in self.systems:
            cells = []
            for m in MEASUREMENTS:
                es = self.entries(k, m)
                cells.append(_f(max(e["others_cores"] for e in es), "{:.2f}") if es else "–")
            self.add(f"| {k} | " + " | ".join(cells) + " |")
        failures = []
        for k in self.systems:
            for m, es in self.results.get(k, {}).items():
                for i, e in enumerate(es, 1):
                    for sub in [e, *(e[p] for p in ("baseline", "long") if p in e), *e.get("rates", [])]:
                        if sub.get("failed"):
                            failures.append(f"- {k} {m} (pass {i}): {sub['failed']} of {sub['sent']} failed "
                                            f"{sub['failures']}")
        self.add("", "Failed requests (counted in every table above, never dropped): "
                     + ("none." if not failures else ""), *failures, "")
        self.add("Timeline:", "", *(f"- {t}" for t in self.meta["timeline"]), "")


MEASUREMENTS = ("unloaded", "decode_b1", "interference", "throughput_c16", "goodput", "prefix")


def _range(value, default: str) -> str:
    return f"{value[0]}–{value[1]}" if value else default


def write_plots(out: Path, systems: dict, plot_data: dict[str, dict[str, BenchResult]], results: dict) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    title = {k: v["title"] for k, v in systems.items()}
    written = []
    inter = {k: d["interference"] for k, d in plot_data.items() if "interference" in d}
    if inter:
        traces, series, styles = [], {}, {}
        for i, (k, res) in enumerate(inter.items()):
            for run in res.runs:
                label = f"{title[k]}, {'without' if run.label == 'baseline' else 'with'} long prompts"
                series[label] = run_latencies(run, "chat")["ITL"]
                styles[label] = {"color": f"C{i}", "ls": ":" if run.label == "baseline" else "-"}
                if run.long_arrivals_s:
                    traces.append(run_itl_trace(run, f"{title[k]}: chat streams, long prompts arriving", "chat"))
        written.append(itl_over_time(traces, out / "interference_itl_over_time.png"))
        written.append(cdf(series, out / "interference_itl_cdf.png", "chat ITL (ms, log)",
                           "chat streams' ITL tail, with (solid) and without (dotted) long prompts", styles, ymin=0.9))
    sweeps = {title[k]: [(p["rate"], p["output_tok_s"], p["goodput"]) for p in results[k]["goodput"][0]["rates"]]
              for k in systems if "goodput" in results.get(k, {})}
    if sweeps:
        written.append(throughput_vs_rate(sweeps, out / "goodput_vs_rate.png", "chat: throughput and goodput vs rate"))
    c16 = {k: d["throughput_c16"] for k, d in plot_data.items() if "throughput_c16" in d}
    if c16:
        written.append(latency_cdfs({title[k]: run_latencies(r.runs[0]) for k, r in c16.items()},
                                    out / "latency_cdfs_c16.png", "chat at max concurrency 16"))
        written.append(bars({k: {"output tok/s": _med(e["output_tok_s"] for e in results[k]["throughput_c16"])}
                             for k in c16}, out / "throughput_c16.png", "output tokens/s",
                            "chat at max concurrency 16 (median of passes)"))
    prefix = {on: {"cache on": results[on]["prefix"][0]["ttft_p50_ms"],
                   "cache off": results[off]["prefix"][0]["ttft_p50_ms"] if off in results else None}
              for on, off in (("coloc", "coloc-noprefix"), ("llama", "llama-noprefix"))
              if "prefix" in results.get(on, {})}
    if prefix:
        written.append(bars(prefix, out / "prefix_ttft.png", "TTFT p50 (ms)", "shared prefix: TTFT p50, cache on / off"))
    decode = {k: {"tok/s": _med(e["tok_s"] for e in results[k]["decode_b1"])} for k in systems
              if "decode_b1" in results.get(k, {})}
    if decode:
        written.append(bars(decode, out / "decode_b1.png", "tokens/s", "decode at batch 1 (through HTTP)"))
    return written


def write_report(out_dir: Path, meta: dict, systems: dict, results: dict, plot_data: dict, roofline: dict,
                 slo: SLO | None, slo_reference: str | None) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    report = Report(meta, systems, results, roofline, slo, slo_reference)
    report.header()
    report.interference()
    report.goodput()
    report.throughput()
    report.prefix()
    report.decode()
    report.noise()
    plots = write_plots(out_dir / "plots", systems, plot_data, results)
    report.add("Plots: " + ", ".join(f"[{p.name}](plots/{p.name})" for p in plots), "")
    (out_dir / "compare.md").write_text("\n".join(report.lines))
    data = {"meta": meta, "systems": systems, "roofline": roofline, "slo": slo and {"ttft_ms": slo.ttft_ms,
            "tpot_ms": slo.tpot_ms, "reference": slo_reference}, "results": results}
    (out_dir / "compare.json").write_text(json.dumps(data, indent=1, allow_nan=False))
