"""Per-request timing and cost: the seed's cost model, prefill-seconds + decode-seconds + KV-transfer
cost, measured for each request and shown to the user.

Workers measure each engine step's time and share it among the sequences in the step by the tokens
each computed (a prompt chunk's tokens, or a decoding row plus its verified proposals), so every
second a worker computes is charged to exactly one request and phase. Prompt chunks are prefill,
decode rows are decode, whatever pool ran them (a conditional decode worker prefilling a short
prompt charges prefill). The KV moved is what the prefill worker wrote and the decode worker read.

Seconds are wall time of the steps; core-seconds weigh each step by the compute units it ran on (on
a CPU the threads: engines on one host lend each other their cores, so a step's width varies; on a
GPU the device, 1). The price is per core-second, so a colocated engine on 2 cores and two pools of
1 core each are charged alike for the same work. `--price prefill=…,decode=…,gb=…,currency=…`
turns them into money; without one the seconds and bytes are still reported. Each response carries `usage.timing_ms` and `usage.cost`;
the gateway's /metrics carries the same as counters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shared.protocol.messages import Timing

GB = 1e9


@dataclass(frozen=True)
class Price:
    prefill_per_s: float = 0.0  # per core-second of prefill compute (GPU: per device-second)
    decode_per_s: float = 0.0  # per core-second of decode compute
    per_gb: float = 0.0  # per GB of KV moved (written by prefill + read by decode)
    currency: str = "USD"

    @classmethod
    def parse(cls, text: str) -> Price:
        """`prefill=0.0004,decode=0.0004,gb=0.01,currency=EUR` (any subset; unknown keys are errors)."""
        fields: dict[str, Any] = {}
        names = {"prefill": "prefill_per_s", "decode": "decode_per_s", "gb": "per_gb", "currency": "currency"}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            if not sep or key.strip() not in names:
                raise ValueError(f"--price: {part!r} is not one of {', '.join(k + '=…' for k in names)}")
            name = names[key.strip()]
            if name == "currency":
                fields[name] = value.strip()
            else:
                fields[name] = float(value)
                if fields[name] < 0:
                    raise ValueError(f"--price: {key} must not be negative")
        return cls(**fields)

    def charge(self, prefill_s: float, decode_s: float, kv_bytes: float) -> dict[str, float]:
        parts = {"prefill": prefill_s * self.prefill_per_s, "decode": decode_s * self.decode_per_s,
                 "kv_transfer": kv_bytes / GB * self.per_gb}
        return parts | {"total": sum(parts.values())}


@dataclass
class RequestCost:
    """One request's compute and transfer, summed over its choices (n > 1)."""

    prefill_s: float = 0.0
    decode_s: float = 0.0
    prefill_core_s: float = 0.0
    decode_core_s: float = 0.0
    kv_bytes: int = 0
    kv_transfer_s: float = 0.0

    @classmethod
    def of(cls, timings: list[Timing]) -> RequestCost:
        cost = cls()
        for t in timings:
            cost.add(t)
        return cost

    def add(self, timing: Timing) -> None:
        self.prefill_s += timing.prefill_compute_s
        self.decode_s += timing.decode_compute_s
        self.prefill_core_s += timing.prefill_core_s
        self.decode_core_s += timing.decode_core_s
        self.kv_bytes += timing.kv_bytes_written + timing.kv_bytes_read
        self.kv_transfer_s += timing.kv_write_s + timing.kv_read_s

    def to_json(self, price: Price) -> dict[str, Any]:
        return {"prefill_seconds": self.prefill_s, "decode_seconds": self.decode_s,
                "prefill_core_seconds": self.prefill_core_s, "decode_core_seconds": self.decode_core_s,
                "kv_bytes": self.kv_bytes, "kv_transfer_seconds": self.kv_transfer_s, "currency": price.currency,
                "price": price.charge(self.prefill_core_s, self.decode_core_s, self.kv_bytes)}


def timing_ms(timing: Timing) -> dict[str, float]:
    """Where the request's time went (choice 0's), in ms: waiting for a prefill worker, prefill,
    KV write + read, waiting for a decode worker, decode."""
    ms = lambda s: round(s * 1e3, 3)  # noqa: E731
    return {"queue": ms(timing.queue_s), "prefill": ms(timing.prefill_s),
            "kv_transfer": ms(timing.kv_write_s + timing.kv_read_s), "decode_queue": ms(timing.decode_queue_s),
            "decode": ms(timing.decode_s)}
