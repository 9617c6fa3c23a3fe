"""`pdserve bench`: a load generator for any OpenAI-compatible endpoint (pdserve, llama-server, vLLM).

    workloads.py   seeded request traces (chat, long-doc, shared-prefix, interference, a JSONL dataset)
    client.py      one streaming request → a RequestRecord (token arrival times, status)
    metrics.py     records → summary (TTFT, TPOT, ITL, E2EL, throughput, goodput), percentiles
    runner.py      BenchConfig → arrivals, concurrency, the interference mix, rate sweeps → BenchResult
    report.py      the text summary and the JSON document
    plots.py       latency CDFs, ITL over time, throughput vs rate (matplotlib, Agg)
    __main__.py    the command line (`pdserve bench`)
"""
