"""pdserve (disaggregated, colocated, colocated without chunked prefill) against llama.cpp's
llama-server, on the same GGUF file and the same 2 cores, driven by the same seeded traces through
`pdserve bench` (services/bench, called as a library).

    .venv/bin/python benchmarks/bench_compare.py            # the full comparison, ~25 min on 2 cores
    .venv/bin/python benchmarks/bench_compare.py --quick    # a smoke run, ~5 min

Writes benchmarks/results/compare.md (tables: absolute numbers and ratios), compare.json (every
measurement's summary numbers) and PNG plots in benchmarks/results/plots/.

Systems run one at a time, each started whole and stopped (and checked gone) before the next, in
the order A B C D for pass 1 and D C B A for pass 2 (full mode). Measurements:

  a. interference: N chat streams at fixed concurrency, ITL p99 without, then with, long-doc prompts
     arriving at fixed intervals (pass 2: with first, then without); ratio with ÷ without. Both passes.
  b. goodput: chat at rising Poisson rates; SLOs = 5× the unloaded TTFT p50 and 2× the unloaded TPOT
     p50, both measured on the first system of pass 1 (pdserve disaggregated) and applied to all.
  c. output-token throughput, chat, closed loop at max concurrency 16. Both passes.
  d. TTFT on shared-prefix (one long prefix, short distinct questions, one at a time) with the prefix
     cache on vs off: pdserve colocated with/without --no-prefix-caching (disaggregated is shown
     "on" only, to keep the run short), llama-server with the prompt cache on (default) vs
     --no-cache-prompt --cache-ram 0.
  e. decode at batch 1: one request at a time, 256 output tokens; tok/s = 1000 / TPOT; MBU = (weight
     bytes + KV bytes) read per step × tok/s ÷ memory read bandwidth measured in this run.
While each measurement runs, the cores used by other processes are recorded (contention). A system
that fails (to start, or mid-way) is logged in the report's timeline and the others still run.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from compare_report import write_report
from compare_systems import SYSTEMS, CpuMonitor, RunningSystem, find_llama_server, llama_repack_works

from services.bench.metrics import SLO, distribution
from services.bench.runner import BenchConfig, BenchResult, chat_summary, run_benchmark
from shared.model.hub import resolve_model_path
from shared.transport.servers import free_port

log = logging.getLogger("bench_compare")
BENCH_DIR = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Settings:
    """Sizes of every measurement (--quick shrinks them)."""

    passes: int = 2
    streams: int = 8  # a. chat streams
    window_s: float = 24.0  # a. the window chat streams run and long prompts arrive in
    warmup_s: float = 4.0  # a. first long prompt; chat ITLs count from here
    long_interval_s: float = 6.0
    chat_output: tuple[int, int] | None = None  # None: the chat workload's 128–256
    long_input: tuple[int, int] | None = None  # None: long-doc's 1,500–3,000
    long_output: tuple[int, int] | None = None  # None: long-doc's 32–128
    unloaded_requests: int = 4
    unloaded_output: tuple[int, int] = (64, 64)
    rates: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0)  # b. req/s
    sweep_requests: int = 16
    c16_requests: int = 32  # c.
    prefix_requests: int = 8  # d. (after one warm-up request)
    prefix_output: tuple[int, int] = (16, 16)
    decode_output: int = 256  # e.
    decode_repeats: int = 2
    ttft_slo_x: float = 5.0
    tpot_slo_x: float = 2.0


FULL = Settings()
QUICK = Settings(passes=1, streams=4, window_s=10.0, warmup_s=2.0, long_interval_s=4.0, chat_output=(32, 64),
                 long_input=(1500, 1800), long_output=(8, 16), unloaded_requests=2, unloaded_output=(32, 32),
                 rates=(1.0, 4.0), sweep_requests=6, c16_requests=16, prefix_requests=3, prefix_output=(8, 8),
                 decode_output=64, decode_repeats=1)

ORDER = ("disagg", "coloc", "coloc-nochunk", "llama")
# Each measurement draws its own prompts (seed + offset), the same for every system: a prompt sent
# twice to one server would hit its prefix cache and look faster the second time.
SEED_OFFSETS = {"warm-up": 100, "unloaded": 200, "decode b1": 300, "interference": 400, "concurrency 16": 500,
                "rate sweep": 600, "shared prefix": 700}
SWEEP_SYSTEMS = ("disagg", "coloc", "llama")  # b.
PREFIX_SYSTEMS = {"coloc": "coloc-noprefix", "llama": "llama-noprefix", "disagg": None}  # d. on → off


class Comparison:
    def __init__(self, settings: Settings, model: Path, llama: Path, seed: int, workdir: Path):
        self.s, self.model, self.llama, self.seed, self.workdir = settings, model, llama, seed, workdir
        self.results: dict[str, dict[str, list[dict]]] = {}  # system → measurement → one entry per pass
        self.plot_data: dict[str, dict[str, BenchResult]] = {}  # system → measurement → pass-1 result
        self.systems: dict[str, dict] = {}
        self.slo: SLO | None = None
        self.slo_reference: str | None = None
        self.timeline: list[str] = []

    # ---------------------------------------------------------------------------------- plumbing

    def bench(self, system: RunningSystem, name: str, **fields) -> tuple[BenchResult, float]:
        """Run one `pdserve bench` configuration against a system (the model name each server lists);
        returns the result and the cores other processes used meanwhile."""
        config = BenchConfig(base_url=system.url, seed=self.seed + SEED_OFFSETS[name], progress=True,
                             label=f"{system.spec.key} {name}", **fields)
        monitor = CpuMonitor(system.pids)
        result = run_benchmark(config)
        return result, monitor.others_cores()

    def record(self, key: str, measurement: str, entry: dict, result: BenchResult | None = None) -> None:
        self.results.setdefault(key, {}).setdefault(measurement, []).append(entry)
        if result is not None:
            self.plot_data.setdefault(key, {}).setdefault(measurement, result)

    def start(self, key: str) -> RunningSystem:
        spec = SYSTEMS[key]
        t0 = time.perf_counter()
        system = RunningSystem(spec, self.model, self.llama, free_port(), self.workdir / key)
        self.systems.setdefault(key, {"title": spec.title, "command": system.command, "threads": spec.threads})
        self.timeline.append(f"{time.strftime('%H:%M:%S')} {key} up in {time.perf_counter() - t0:.1f} s")
        warm, _ = self.bench(system, "warm-up", num_requests=2, max_concurrency=2, output_tokens=(8, 8),
                             prompt_tokens=(50, 80))
        if warm.runs[0].summary["failed"]:
            raise RuntimeError(f"{spec.title}: the warm-up requests failed: {warm.runs[0].records}")
        return system

    # ------------------------------------------------------------------------------ measurements

    def unloaded(self, system: RunningSystem) -> None:
        res, others = self.bench(system, "unloaded", num_requests=self.s.unloaded_requests, max_concurrency=1,
                                 output_tokens=self.s.unloaded_output)
        s = res.runs[0].summary
        entry = {"ttft_p50_ms": _p(s, "ttft_ms", "p50"), "tpot_p50_ms": _p(s, "tpot_ms", "p50"),
                 "itl_p50_ms": _p(s, "itl_ms", "p50"), **_counts(s), "others_cores": others}
        self.record(system.spec.key, "unloaded", entry)
        if self.slo is None:  # the first system measured sets the SLOs for all
            self.slo = SLO(ttft_ms=self.s.ttft_slo_x * entry["ttft_p50_ms"], tpot_ms=self.s.tpot_slo_x * entry["tpot_p50_ms"])
            self.slo_reference = system.spec.key

    def decode_b1(self, system: RunningSystem) -> None:
        res, others = self.bench(system, "decode b1", num_requests=self.s.decode_repeats, max_concurrency=1,
                                 prompt_tokens=(100, 100), output_tokens=(self.s.decode_output, self.s.decode_output))
        run = res.runs[0]
        tpots = [r.tpot_s * 1e3 for r in run.records if r.ok and r.tpot_s]
        tpot = statistics.median(tpots) if tpots else None
        ctx = [r.prompt_tokens + r.output_tokens / 2 for r in run.records if r.ok]
        self.record(system.spec.key, "decode_b1", {"tpot_ms": tpot, "tok_s": 1e3 / tpot if tpot else None,
                                                   "mean_context": statistics.mean(ctx) if ctx else None,
                                                   **_counts(run.summary), "others_cores": others})

    def interference(self, system: RunningSystem, phases: tuple[str, ...]) -> None:
        s = self.s
        res, others = self.bench(system, "interference", workload="interference", max_concurrency=s.streams,
                                 duration_s=s.window_s, warmup_s=s.warmup_s, long_interval_s=s.long_interval_s,
                                 output_tokens=s.chat_output, long_prompt_tokens=s.long_input,
                                 long_output_tokens=s.long_output, interference_phases=phases)
        entry: dict = {"order": list(phases), "others_cores": others}
        for run in res.runs:
            chat = chat_summary(run)
            longs = run.summary.get("by_kind", {}).get("long")
            entry["baseline" if run.label == "baseline" else "long"] = {
                "chat_itl_p50_ms": _p(chat, "itl_ms", "p50"), "chat_itl_p99_ms": _p(chat, "itl_ms", "p99"),
                "chat_itl_max_ms": _p(chat, "itl_ms", "max"), "chat_itls": _p(chat, "itl_ms", "n"),
                "chat_ttft_p50_ms": _p(chat, "ttft_ms", "p50"),
                "long_ttft_p50_ms": _p(longs, "ttft_ms", "p50") if longs else None,
                "long_arrivals_s": run.long_arrivals_s, **_counts(run.summary)}
        ratio = res.interference
        entry["ratio"] = ratio["ratio"] if ratio else None
        self.record(system.spec.key, "interference", entry, res)

    def throughput_c16(self, system: RunningSystem) -> None:
        res, others = self.bench(system, "concurrency 16", workload="chat", num_requests=self.s.c16_requests,
                                 max_concurrency=16, output_tokens=self.s.chat_output)
        s = res.runs[0].summary
        self.record(system.spec.key, "throughput_c16", {
            "output_tok_s": s["output_throughput"], "request_s": s["request_throughput"],
            "total_tok_s": s["total_token_throughput"], "ttft_p50_ms": _p(s, "ttft_ms", "p50"),
            "tpot_p50_ms": _p(s, "tpot_ms", "p50"), "itl_p99_ms": _p(s, "itl_ms", "p99"), **_counts(s),
            "others_cores": others}, res)

    def goodput_sweep(self, system: RunningSystem) -> None:
        res, others = self.bench(system, "rate sweep", workload="chat", num_requests=self.s.sweep_requests,
                                 request_rates=self.s.rates, output_tokens=self.s.chat_output, slo=self.slo)
        rates = []
        for run in res.runs:
            s = run.summary
            rates.append({"rate": run.request_rate, "goodput": s["goodput"]["request_goodput"],
                          "attainment_pct": s["goodput"]["attainment_pct"], "output_tok_s": s["output_throughput"],
                          "ttft_p50_ms": _p(s, "ttft_ms", "p50"), "ttft_p99_ms": _p(s, "ttft_ms", "p99"),
                          "tpot_p50_ms": _p(s, "tpot_ms", "p50"), "tpot_p99_ms": _p(s, "tpot_ms", "p99"),
                          **_counts(s)})
        self.record(system.spec.key, "goodput", {"slo": asdict(self.slo), "slo_reference": self.slo_reference,
                                                 "rates": rates, "others_cores": others}, res)

    def prefix(self, system: RunningSystem) -> None:
        """Request 0 fills the cache with the shared prefix; TTFT is taken over requests 1..N."""
        res, others = self.bench(system, "shared prefix", workload="shared-prefix", max_concurrency=1,
                                 num_requests=self.s.prefix_requests + 1, output_tokens=self.s.prefix_output)
        run = res.runs[0]
        measured = [r for r in run.records if r.index > 0]
        ttft = distribution(r.ttft_s for r in measured if r.ok and r.ttft_s is not None)
        self.record(system.spec.key, "prefix", {
            "cold_ttft_ms": run.records[0].ttft_s * 1e3 if run.records[0].ok else None,
            "ttft_p50_ms": ttft and ttft["p50"], "ttft_p90_ms": ttft and ttft["p90"],
            "ttft_mean_ms": ttft and ttft["mean"], "prompt_tokens": statistics.mean(r.prompt_tokens for r in measured),
            **_counts(run.summary), "others_cores": others})

    # ---------------------------------------------------------------------------------- the plan

    def run(self, between_passes=lambda: None) -> None:
        for pass_no in range(1, self.s.passes + 1):
            if pass_no > 1:
                between_passes()
            order = ORDER if pass_no % 2 else tuple(reversed(ORDER))
            if pass_no == 1:
                order += tuple(off for off in PREFIX_SYSTEMS.values() if off)
            for key in order:
                try:
                    self.run_system(key, pass_no)
                except Exception as exc:  # one system failing must not lose the others' results
                    log.exception("%s failed in pass %d", key, pass_no)
                    self.timeline.append(f"{time.strftime('%H:%M:%S')} {key} FAILED (pass {pass_no}): {exc!r}"[:300])

    def run_system(self, key: str, pass_no: int) -> None:
        log.warning("pass %d: %s", pass_no, SYSTEMS[key].title)
        system = self.start(key)
        try:
            if key in PREFIX_SYSTEMS.values():  # only the prefix-cache-off comparison
                self.prefix(system)
                return
            phases = ("baseline", "long") if pass_no % 2 else ("long", "baseline")
            if pass_no == 1:
                self.unloaded(system)
            self.decode_b1(system)
            self.interference(system, phases)
            self.throughput_c16(system)
            if pass_no == 1 and key in SWEEP_SYSTEMS:
                self.goodput_sweep(system)
            if pass_no == 1 and key in PREFIX_SYSTEMS:
                self.prefix(system)
        finally:
            system.stop()
            self.timeline.append(f"{time.strftime('%H:%M:%S')} {key} stopped (pass {pass_no})")


def _p(summary: dict | None, metric: str, stat: str) -> float | None:
    dist = (summary or {}).get(metric)
    return dist[stat] if dist else None


def _counts(summary: dict) -> dict:
    return {"sent": summary["sent"], "failed": summary["failed"], "failures": summary["failures"]}


PROBE = """
import json, sys
sys.path.insert(0, sys.argv[1])
from bench_model import measure_bandwidth, step_weight_bytes
out = {"bandwidth_GBps": measure_bandwidth()}
if sys.argv[3] == "1":
    from shared.config import EngineConfig
    from shared.engine.engine import LLMEngine
    # what `pdserve up` runs by default: the file's weight blocks, fp32 activations
    engine = LLMEngine.from_config(EngineConfig(model=sys.argv[2], num_kv_blocks=64))
    out["pdserve_weight_bytes_b1"] = step_weight_bytes(engine.model)
    out["kv_values_per_token"] = engine.model.config.kv_values_per_token
print(json.dumps(out))
"""


def roofline_probe(model: Path, with_weights: bool) -> dict:
    """Memory read bandwidth (and pdserve's bytes per batch-1 decode step) in a child process, so
    this client process stays small; run while no system is up."""
    out = subprocess.run([sys.executable, "-c", PROBE, str(BENCH_DIR), str(model), "1" if with_weights else "0"],
                         capture_output=True, text=True, check=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


def gguf_weight_bytes(model: Path) -> int:
    """Bytes of tensor data in the GGUF: what llama.cpp reads per decode step (the tied embedding is
    the output head, so it is read whole)."""
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(str(model)).tensors)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a few-minute smoke run (one pass, small sizes)")
    ap.add_argument("--model", default=None, help="GGUF file (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--llama-server", default=None, help="llama-server binary (default: build_llama_server.sh's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default=str(BENCH_DIR / "results"))
    ap.add_argument("--workdir", default=None, help="servers' logs (default: a temp dir)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")

    settings = QUICK if args.quick else FULL
    model = resolve_model_path(args.model)
    llama = find_llama_server(args.llama_server)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-compare-"))
    started = time.time()
    first = roofline_probe(model, with_weights=True)
    roofline = {"pdserve_weight_bytes_b1": first.pop("pdserve_weight_bytes_b1"),
                "kv_values_per_token": first.pop("kv_values_per_token"),
                "llama_weight_bytes": gguf_weight_bytes(model), "probes": [first | {"when": "before"}]}
    comparison = Comparison(settings, model, llama, args.seed, workdir)
    comparison.run(lambda: roofline["probes"].append(roofline_probe(model, False) | {"when": "between passes"}))
    roofline["probes"].append(roofline_probe(model, with_weights=False) | {"when": "after"})
    meta = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "quick": args.quick,
            "settings": asdict(replace(settings, rates=tuple(settings.rates))), "model": str(model),
            "model_bytes": model.stat().st_size, "llama_server": str(llama), "seed": args.seed,
            "llama_no_repack": not llama_repack_works(llama, model),
            "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
            "wall_s": time.time() - started, "workdir": str(workdir), "timeline": comparison.timeline,
            "order": {"pass 1": list(ORDER), "pass 2": list(reversed(ORDER))} if settings.passes > 1 else
                     {"pass 1": list(ORDER)}}
    write_report(Path(args.out_dir), meta, comparison.systems, comparison.results, comparison.plot_data, roofline,
                 comparison.slo, comparison.slo_reference)
    print(f"wrote {args.out_dir}/compare.md, compare.json, plots/ in {(time.time() - started) / 60:.1f} min",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
