"""`pdserve prefill` / `python -m services.prefill`: one prefill worker."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from shared.cli_args import add_worker_args, worker_config
from shared.engine.engine import LLMEngine
from shared.transport.worker import run_worker
from services.prefill.worker import PrefillWorker


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve prefill", description=__doc__)
    add_worker_args(p)
    p.add_argument("--nice", type=int, default=int(os.environ.get("PDSERVE_PREFILL_NICE", "10")),
                   help="CPU priority offset: on a host shared with decode workers and the gateway, token "
                        "delivery wins over prefill (0: none; no effect on a host of its own)")
    p.add_argument("--log-level", default="INFO")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = worker_config(args, "prefill")
    if args.nice:
        os.nice(args.nice)
    engine = LLMEngine.from_config(config.engine)
    asyncio.run(run_worker(PrefillWorker(config, engine)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
