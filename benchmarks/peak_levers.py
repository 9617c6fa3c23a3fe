"""Two more levers on the planning study's peak (BENCHMARKS.md, 2026-12-07): fewer prefill workers
than the planned 213 TP4, with the prefill queue served shortest prompt first, or with the short
prompts sent to the decode pool (conditional mode). The study's busiest 240 s (85,819 requests at
~357 req/s), its roofline profiles and SLOs (TTFT <= 4 s, TPOT <= 40 ms).

    python benchmarks/peak_levers.py fifo 213,190,170
    python benchmarks/peak_levers.py sjf 213,190,170,150
    python benchmarks/peak_levers.py conditional 200:25:2048:512,190:27:2048:1024

`sjf` is not a pdserve mode: the simulator's prefill queue is replaced here by one that hands a
worker the shortest waiting prompt (the real queue is a JetStream work queue, first in first out).
"""

from __future__ import annotations

import heapq
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))

from services.planner.plan import pool_profiles  # noqa: E402
from services.planner.study import busiest, trace  # noqa: E402
from shared.sim.cluster import Cluster, ClusterConfig, simulate  # noqa: E402
from shared.sim.cost import load_profile  # noqa: E402

PROFILES = Path(__file__).parents[1] / "shared/sim/profiles"


class ShortestFirst:
    """The prefill queue's interface (append, popleft, len) over a heap of (prompt tokens, request)."""

    def __init__(self, cluster: Cluster):
        self.heap: list[tuple[int, int]] = []
        self.cluster = cluster

    def append(self, rid: int) -> None:
        heapq.heappush(self.heap, (self.cluster.reqs[rid].prompt_tokens, rid))

    def popleft(self) -> int:
        return heapq.heappop(self.heap)[1]

    def __len__(self) -> int:
        return len(self.heap)


def main(policy: str, specs: str) -> None:
    if policy == "sjf":
        init = Cluster.__init__

        def shortest_first(self, *args, **kwargs):
            init(self, *args, **kwargs)
            self.prefill_q = ShortestFirst(self)

        Cluster.__init__ = shortest_first
    main_profile, prefill_profile = pool_profiles(load_profile(PROFILES / "roofline-llama3-70b-tp8-h100.json"),
                                                  load_profile(PROFILES / "roofline-llama3-70b-tp4-h100.json"))
    peak = busiest(trace(240, 3600, 0), 240)
    print(f"{len(peak)} requests; prompts < 1,024 tokens: {sum(r.prompt_tokens < 1024 for r in peak) / len(peak):.1%}, "
          f"< 2,048: {sum(r.prompt_tokens < 2048 for r in peak) / len(peak):.1%}")
    for spec in specs.split(","):
        fields = spec.split(":")  # PREFILL[:DECODE[:THRESHOLD[:CHUNK]]]
        prefill, decode, threshold, chunk = fields + ["25", "256", "-"][len(fields) - 1:]
        config = ClusterConfig(mode="conditional" if policy == "conditional" else "disaggregated", kv_path="network",
                               prefill=int(prefill), decode=int(decode), prefill_max_inflight=2,
                               conditional_threshold=int(threshold),
                               max_num_batched_tokens=None if chunk == "-" else int(chunk))
        t0 = time.perf_counter()
        s = simulate(main_profile, config, [replace(r) for r in peak], slo_ttft_ms=4000, slo_tpot_ms=40,
                     prefill_profile=prefill_profile)
        att = s["slo_attainment"]
        print(f"{policy} {spec}: {s['per_gpu']['gpus']:.0f} GPUs, TTFT met {att['ttft_pct']:.1f}%, TPOT met "
              f"{att['tpot_pct']:.1f}%, TTFT p50/p90/p99 {s['ttft_ms']['p50']:.0f}/{s['ttft_ms']['p90']:.0f}/"
              f"{s['ttft_ms']['p99']:.0f} ms ({time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
