"""A discrete-event simulator of pdserve in virtual time (pure Python: no asyncio, no transport).

    cost.py       step and transfer times from a profile file (`pdserve profile` measures one)
    workload.py   requests: pdserve bench's seeded workloads, JSONL traces, Mooncake-style traces
    engine.py     one simulated worker: the real scheduler's policy, with multi-step decode spans
    cluster.py    the event loop: routing, prefill pool, KV transfer, decode pool, prefix cache
    metrics.py    what `pdserve bench` reports (TTFT / ITL / TPOT / E2EL, throughput, goodput)
"""
