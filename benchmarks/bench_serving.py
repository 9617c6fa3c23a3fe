"""Serving benchmark: pdserve through HTTP, disaggregated vs colocated, side by side in one run.

    .venv/bin/python benchmarks/bench_serving.py [--quick] [--out benchmarks/results/serving.md]

For each mode it starts a whole stack (`pdserve up` machinery: nats-server, valkey-server, kvstore,
workers, gateway) on this machine and measures, through real streaming HTTP:
  1. light load: TTFT and ITL of single chat requests, one at a time, next to the offline engine
     (same prompts, same process count of 1) → the services' overhead;
  2. KV transfer: for a 2,000-token prompt, the server-side kv_write + kv_read time (from
     /metrics) as a fraction of that prompt's prefill time;
  3. interference: 8 chat streams decoding while 2,000-token prompts arrive; the streams' ITL p50/p99
     with and without the long prompts.
Modes are run in the order A B B A so drift hits both alike; medians are reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field

import httpx

MODEL = "SmolLM2-135M-Instruct"


@dataclass
class StreamResult:
    ttft: float = 0.0
    itls: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str = ""


def stream_completion(url: str, prompt: str, max_tokens: int, stop_event: threading.Event | None = None) -> StreamResult:
    """One streaming /v1/completions request; arrival time of every chunk."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True}
    res = StreamResult()
    t0 = time.perf_counter()
    last = None
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = str(chunk["error"])
                    break
                if not chunk["choices"] or not chunk["choices"][0].get("text"):
                    continue
                now = time.perf_counter()
                if last is None:
                    res.ttft = now - t0
                else:
                    res.itls.append(now - last)
                last = now
                res.tokens += 1
                if stop_event is not None and stop_event.is_set():
                    break
    except httpx.HTTPError as exc:
        res.error = repr(exc)
    return res


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))]


def chat_prompt(i: int) -> str:
    topics = ["the ocean", "mountains", "a city at night", "the history of tea", "how bridges work",
              "a robot learning to paint", "winter in the north", "the first computers"]
    return f"Write a long, detailed essay about {topics[i % len(topics)]}. Essay {i}:"


def long_prompt(i: int, words: int = 1500) -> str:
    body = " ".join(f"Item {k} of list {i} has the value {(k * 7919 + i) % 1000}." for k in range(words // 9))
    return body + "\nSummarise the list:"


def light_load(url: str, n: int) -> dict:
    ttfts, itls = [], []
    for i in range(n):
        r = stream_completion(url, chat_prompt(i), 32)
        assert not r.error, r.error
        ttfts.append(r.ttft)
        itls += r.itls
    return {"ttft_p50": pct(ttfts, 50), "ttft_p99": pct(ttfts, 99), "itl_p50": pct(itls, 50), "itl_p99": pct(itls, 99)}


def interference(url: str, window_s: float, long_every_s: float, with_long: bool) -> dict:
    stop = threading.Event()
    results: list[StreamResult] = []
    long_ttfts: list[float] = []

    def chat_stream(i):
        results.append(stream_completion(url, chat_prompt(100 + i), 2000, stop))

    streams = [threading.Thread(target=chat_stream, args=(i,)) for i in range(8)]
    for t in streams:
        t.start()
    time.sleep(3.0)  # let the streams reach steady decoding
    t_end = time.monotonic() + window_s
    longs = []
    k = 0
    while with_long and time.monotonic() < t_end:
        def one_long(k=k):
            r = stream_completion(url, long_prompt(k), 4)
            long_ttfts.append(r.ttft)
        th = threading.Thread(target=one_long)
        th.start()
        longs.append(th)
        k += 1
        time.sleep(long_every_s)
    while time.monotonic() < t_end:
        time.sleep(0.1)
    stop.set()
    for t in streams + longs:
        t.join()
    itls = [x for r in results for x in r.itls[5:]]  # skip the start-up gaps
    return {"itl_p50": pct(itls, 50), "itl_p99": pct(itls, 99), "itl_max": max(itls) if itls else float("nan"),
            "long_prompts": k, "long_ttft_p50": pct(long_ttfts, 50), "errors": sum(1 for r in results if r.error)}


def metric_sum(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ") or
               line.startswith(name + "{"))


def kv_transfer_fraction(url: str) -> dict:
    """Server-side KV transfer vs prefill time of one 2,000-token prompt (from the gateway's histograms)."""
    before = metric_sum(url, "pdserve_kv_transfer_seconds_sum")
    t0 = time.perf_counter()
    r = stream_completion(url, long_prompt(999, words=1700), 2)
    assert not r.error, r.error
    after = metric_sum(url, "pdserve_kv_transfer_seconds_sum")
    return {"ttft": r.ttft, "kv_transfer_s": after - before, "wall": time.perf_counter() - t0}


def run_mode(mode: str, args) -> dict:
    from services.up import add_up_args, start_stack, wait_healthy
    from shared.transport.servers import free_port

    parser = argparse.ArgumentParser()
    add_up_args(parser)
    extra = ["--mode", mode] + (["--decode", "1"] if mode == "colocated" else ["--prefill", "1", "--decode", "1"])
    up_args = parser.parse_args(["--port", str(free_port()), *extra])
    stack, url = start_stack(up_args)
    try:
        wait_healthy(stack, url)
        stream_completion(url, chat_prompt(0), 4)  # warm-up
        out = {"light": light_load(url, args.light_n)}
        if mode != "colocated":
            out["kv"] = kv_transfer_fraction(url)
        out["baseline"] = interference(url, args.window, args.long_every, with_long=False)
        out["interference"] = interference(url, args.window, args.long_every, with_long=True)
        return out
    finally:
        stack.stop()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--window", type=float, default=20.0)
    ap.add_argument("--long-every", type=float, default=4.0)
    ap.add_argument("--light-n", type=int, default=8)
    ap.add_argument("--out", default="benchmarks/results/serving.md")
    args = ap.parse_args()
    if args.quick:
        args.window, args.light_n = 10.0, 3
    order = ["disaggregated", "colocated"] if args.quick else ["disaggregated", "colocated", "colocated", "disaggregated"]
    runs: dict[str, list[dict]] = {}
    for mode in order:
        print(f"running {mode} ...", file=sys.stderr, flush=True)
        runs.setdefault(mode, []).append(run_mode(mode, args))
    lines = [f"# pdserve serving benchmark\n\ncommand: `{' '.join(sys.argv)}`\n",
             "1 prefill + 1 decode worker (disaggregated) vs 1 engine worker (colocated), 2 cores, bf16 + int8 "
             "weights; medians over runs in order " + " ".join(order) + ".\n",
             "| measure | disaggregated | colocated |", "|---|---|---|"]

    def med(mode, *path):
        vals = []
        for r in runs[mode]:
            v = r
            for p in path:
                v = v.get(p, {}) if isinstance(v, dict) else float("nan")
            vals.append(v if isinstance(v, (int, float)) else float("nan"))
        return statistics.median(vals)

    rows = [("light load TTFT p50 (ms)", ("light", "ttft_p50"), 1000), ("light load ITL p50 (ms)", ("light", "itl_p50"), 1000),
            ("light load ITL p99 (ms)", ("light", "itl_p99"), 1000),
            ("8 streams, no long prompts: ITL p50 (ms)", ("baseline", "itl_p50"), 1000),
            ("8 streams, no long prompts: ITL p99 (ms)", ("baseline", "itl_p99"), 1000),
            ("8 streams + long prompts: ITL p50 (ms)", ("interference", "itl_p50"), 1000),
            ("8 streams + long prompts: ITL p99 (ms)", ("interference", "itl_p99"), 1000),
            ("8 streams + long prompts: ITL max (ms)", ("interference", "itl_max"), 1000),
            ("long prompts sent", ("interference", "long_prompts"), 1),
            ("long prompt TTFT p50 (ms)", ("interference", "long_ttft_p50"), 1000)]
    for label, path, scale in rows:
        lines.append(f"| {label} | {med('disaggregated', *path) * scale:.1f} | {med('colocated', *path) * scale:.1f} |")
    for mode in ("disaggregated", "colocated"):
        ratio = med(mode, "interference", "itl_p99") / med(mode, "baseline", "itl_p99")
        lines.append(f"| ITL p99 ratio with/without long prompts ({mode}) | {ratio:.2f} | |" if mode == "disaggregated"
                     else f"| ITL p99 ratio with/without long prompts ({mode}) | | {ratio:.2f} |")
    kv = med("disaggregated", "kv", "kv_transfer_s")
    ttft = med("disaggregated", "kv", "ttft")
    lines.append(f"| 2,000-token prompt: KV transfer (write+read) / TTFT | {1000 * kv:.1f} ms / {1000 * ttft:.0f} ms = "
                 f"{100 * kv / ttft:.1f}% | |")
    report = "\n".join(lines) + "\n\nraw:\n```json\n" + json.dumps(runs, indent=1) + "\n```\n"
    print(report)
    with open(args.out, "w") as f:
        f.write(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
