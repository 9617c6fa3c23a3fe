"""What decode rows add to a step that computes a prompt's chunk, in-process (the simulator's
`Profile.riding_decode_time`):

    .venv/bin/python benchmarks/bench_mixed_step.py THREADS
"""
import sys, logging
from services.planner.profile import ProfileConfig, Profiler, _median_time
from shared.cli_args import add_engine_args, engine_config
import argparse
threads = sys.argv[1]
ap = argparse.ArgumentParser(); add_engine_args(ap)
engine = engine_config(ap.parse_args(["--threads", threads]))
prof = Profiler(ProfileConfig(engine=engine, quick=False))
def t(specs):
    ch = prof._chunks(specs)
    return _median_time(lambda: prof._forward(ch), 5)
for chunk, off in ((512, 0), (512, 1536), (256, 128)):
    base = t([(chunk, off)])
    for B, ctx in ((4, 2300), (10, 2300), (10, 300), (20, 300)):
        for rows in (1, 3):
            mixed = t([(chunk, off)] + [(rows, ctx)] * B)
            dec = t([(rows, ctx)] * B)
            print(f"threads {threads} chunk {chunk}@{off}: {base*1e3:.0f} ms; + {B} rows×{rows} at ctx {ctx}: {mixed*1e3:.0f} ms "
                  f"(+{(mixed-base)*1e3:.1f} ms); those rows alone: {dec*1e3:.1f} ms")
