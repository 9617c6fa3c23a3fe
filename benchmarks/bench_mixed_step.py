"""What decode rows add to a step that computes a prompt's chunk, in-process (the simulator's
`Profile.riding_decode_time`): a chunk alone, the chunk with B decode rows (1 or 3 rows each: a
token, or a token and 2 drafts) at a context length, and those rows alone as a decode step.

    .venv/bin/python benchmarks/bench_mixed_step.py [THREADS]      (default 2)
"""

from __future__ import annotations

import argparse
import sys

from services.planner.profile import ProfileConfig, Profiler, _median_time
from shared.cli_args import add_engine_args, engine_config


def main() -> None:
    threads = sys.argv[1] if len(sys.argv) > 1 else "2"
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    profiler = Profiler(ProfileConfig(engine=engine_config(parser.parse_args(["--threads", threads]))))

    def seconds(specs: list[tuple[int, int]]) -> float:
        chunks = profiler._chunks(specs)
        return _median_time(lambda: profiler._forward(chunks), 5)

    for chunk, offset in ((512, 0), (512, 1536), (256, 128)):
        alone = seconds([(chunk, offset)])
        for batch, ctx in ((4, 2300), (10, 2300), (10, 300), (20, 300)):
            for rows in (1, 3):
                mixed = seconds([(chunk, offset)] + [(rows, ctx)] * batch)
                decode = seconds([(rows, ctx)] * batch)
                print(f"threads {threads}, chunk {chunk} at {offset}: {1e3 * alone:.0f} ms; + {batch} × {rows} rows at "
                      f"context {ctx}: {1e3 * mixed:.0f} ms (+{1e3 * (mixed - alone):.1f}); the rows alone "
                      f"{1e3 * decode:.1f} ms")


if __name__ == "__main__":
    main()
