"""`pdserve cost`: what a load cost, per phase, from measured numbers.

Reads a `pdserve bench --json` file (each request's `usage.cost` as pdserve reported it) or a live
gateway's /metrics (its cost counters), and prints the cost per 1,000 requests and per million
tokens, split into prefill-seconds, decode-seconds and KV moved, priced with `--price` (the same
syntax as `pdserve up --price`). With `--compare OTHER.json` (say, the same workload against
`pdserve up --mode colocated`) the two are side by side: the seed's comparison of disaggregated and
colocated serving, on what each actually computed.

    pdserve cost bench-disagg.json --compare bench-colocated.json --price prefill=1,decode=1,gb=0.05
    pdserve cost --url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from services.gateway.cost import GB, Price


@dataclass
class Totals:
    """A load's requests, tokens, compute and KV moved."""

    label: str
    requests: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    prefill_core_s: float = 0.0
    decode_core_s: float = 0.0
    kv_bytes: float = 0.0
    without_cost: int = 0  # ok requests whose server reported no cost (not pdserve, or an old one)

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens


def from_bench_json(path: str | Path) -> Totals:
    data = json.loads(Path(path).read_text())
    totals = Totals(label=Path(path).stem)
    for run in data.get("runs", []):
        for rec in run.get("records", []):
            if rec.get("status") != "ok":
                continue
            cost = rec.get("cost")
            if not cost:
                totals.without_cost += 1
                continue
            totals.requests += 1
            totals.prompt_tokens += int(rec.get("prompt_tokens") or 0)
            totals.output_tokens += int(rec.get("output_tokens") or 0)
            totals.prefill_s += float(cost["prefill_seconds"])
            totals.decode_s += float(cost["decode_seconds"])
            totals.prefill_core_s += float(cost.get("prefill_core_seconds", cost["prefill_seconds"]))
            totals.decode_core_s += float(cost.get("decode_core_seconds", cost["decode_seconds"]))
            totals.kv_bytes += float(cost["kv_bytes"])
    return totals


def from_gateway(url: str) -> Totals:
    text = httpx.get(f"{url.rstrip('/')}/metrics", timeout=10).text

    def value(name: str, labels: str = "") -> float:
        pattern = rf"^{name}(\{{[^}}]*\}})?\s+([0-9.eE+-]+)$"
        return sum(float(m.group(2)) for m in re.finditer(pattern, text, re.M)
                   if labels in (m.group(1) or ""))

    return Totals(label=url, requests=int(value("pdserve_requests_total", 'status="success"')),
                  prompt_tokens=int(value("pdserve_prompt_tokens_total")),
                  output_tokens=int(value("pdserve_generation_tokens_total")),
                  prefill_s=value("pdserve_prefill_seconds_total"), decode_s=value("pdserve_decode_seconds_total"),
                  prefill_core_s=value("pdserve_prefill_core_seconds_total"),
                  decode_core_s=value("pdserve_decode_core_seconds_total"),
                  kv_bytes=value("pdserve_kv_transfer_bytes_total"))


def rows(t: Totals, price: Price) -> dict[str, float | None]:
    """The table's numbers for one load."""
    money = price.charge(t.prefill_core_s, t.decode_core_s, t.kv_bytes)
    per_k = 1000 / t.requests if t.requests else None
    per_m = 1e6 / t.tokens if t.tokens else None
    scale = lambda x, f: None if f is None else x * f  # noqa: E731
    return {
        "requests": t.requests, "tokens": t.tokens,
        "prefill-seconds / 1k requests": scale(t.prefill_s, per_k),
        "decode-seconds / 1k requests": scale(t.decode_s, per_k),
        "prefill core-seconds / 1k requests": scale(t.prefill_core_s, per_k),
        "decode core-seconds / 1k requests": scale(t.decode_core_s, per_k),
        "KV GB moved / 1k requests": scale(t.kv_bytes / GB, per_k),
        f"prefill {price.currency} / 1k requests": scale(money["prefill"], per_k),
        f"decode {price.currency} / 1k requests": scale(money["decode"], per_k),
        f"KV transfer {price.currency} / 1k requests": scale(money["kv_transfer"], per_k),
        f"total {price.currency} / 1k requests": scale(money["total"], per_k),
        f"total {price.currency} / 1M tokens": scale(money["total"], per_m),
        "core-seconds / 1M tokens": scale(t.prefill_core_s + t.decode_core_s, per_m),
    }


def format_table(loads: list[Totals], price: Price) -> str:
    tables = [rows(t, price) for t in loads]
    head = ["measure"] + [t.label for t in loads] + (["ratio"] if len(loads) == 2 else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key in tables[0]:
        values = [tab[key] for tab in tables]
        cells = [_fmt(v) for v in values]
        if len(loads) == 2:
            a, b = values
            cells.append(f"{b / a:.2f}×" if isinstance(a, (int, float)) and a and b is not None else "–")
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    notes = [f"{t.label}: {t.without_cost} ok requests carried no cost (not counted)" for t in loads if t.without_cost]
    return "\n".join(lines + notes)


def _fmt(v: float | int | None) -> str:
    if v is None:
        return "–"
    if isinstance(v, int):
        return f"{v:,}"
    return f"{v:.4g}"


def add_cost_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("bench_json", nargs="?", help="a `pdserve bench --json` file")
    p.add_argument("--compare", help="a second bench JSON (e.g. the same workload colocated), side by side")
    p.add_argument("--url", help="a live gateway instead of a file: its /metrics counters")
    p.add_argument("--price", default="prefill=1,decode=1,gb=0", type=Price.parse,
                   help="prefill=P,decode=D,gb=G,currency=C per core-second (GPU: device-second) and GB of KV "
                        "moved (default: 1 per core-second, KV free)")
    p.add_argument("--json", help="also write the numbers here")


def cmd_cost(args: argparse.Namespace) -> int:
    if (args.bench_json is None) == (args.url is None):
        print("pdserve cost: give a bench JSON file or --url, not both", file=sys.stderr)
        return 2
    loads = [from_gateway(args.url) if args.url else from_bench_json(args.bench_json)]
    if args.compare:
        loads.append(from_bench_json(args.compare))
    if not any(t.requests for t in loads):
        print("pdserve cost: no request with a reported cost (was the server pdserve?)", file=sys.stderr)
        return 1
    print(format_table(loads, args.price))
    if args.json:
        out: dict[str, Any] = {t.label: rows(t, args.price) for t in loads}
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0
