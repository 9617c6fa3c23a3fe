"""`python -m services.kvstore`: run one kvstore (one per host).

    python -m services.kvstore --model PATH --dtype bfloat16 --num-slots 2048
    python -m services.kvstore --block-bytes 4096 --layout test --num-slots 8      (no model needed)

Environment variables (read here, once) give the defaults of the connection options, so secrets
need not appear on the command line.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from shared.cli_args import add_connection_args, connection_fields
from services.kvstore.config import KVStoreConfig, default_store_name, layout_for_model
from services.kvstore.service import run_kvstore

log = logging.getLogger("pdserve.kvstore")


def build_parser() -> argparse.ArgumentParser:
    env = os.environ.get
    p = argparse.ArgumentParser(prog="python -m services.kvstore", description="pdserve KV block store")
    p.add_argument("--store", default=env("PDSERVE_KVSTORE") or default_store_name(),
                   help="instance name (a NATS subject token; default kv-<hostname>-<pid>)")
    p.add_argument("--num-slots", type=int, default=int(env("PDSERVE_KV_SLOTS", "2048")), help="pool size in blocks")
    p.add_argument("--model", default=env("PDSERVE_MODEL"),
                   help="checkpoint whose KV block layout to store (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default=env("PDSERVE_DTYPE", "bfloat16"), help="KV cache dtype of the workers")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block")
    p.add_argument("--block-bytes", type=int, default=None, help="give the block size directly (with --layout)")
    p.add_argument("--layout", default=None, help="layout string to announce (with --block-bytes)")
    add_connection_args(p)
    p.add_argument("--no-shm", action="store_true", help="private memory: network data path only")
    p.add_argument("--heartbeat", type=float, default=1.0, help="seconds between stats/registry updates")
    p.add_argument("--log-level", default=env("PDSERVE_LOG_LEVEL", "INFO"))
    return p


def config_from_args(args: argparse.Namespace) -> KVStoreConfig:
    if (args.block_bytes is None) != (args.layout is None):
        raise ValueError("--block-bytes and --layout go together")
    if args.block_bytes is None:
        block_bytes, layout = layout_for_model(args.model, args.dtype, args.block_size)
    else:
        block_bytes, layout = args.block_bytes, args.layout
    return KVStoreConfig(
        block_bytes=block_bytes, layout=layout, num_slots=args.num_slots, store=args.store,
        block_size=args.block_size, **connection_fields(args), shared_memory=not args.no_shm, heartbeat_s=args.heartbeat,
        registry_ttl_s=max(5.0, 5 * args.heartbeat),
    )


async def _serve(config: KVStoreConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)  # signal → Event → stop taking work → drain → close
    await run_kvstore(config, stop)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
        asyncio.run(_serve(config))
    except (ValueError, FileNotFoundError, MemoryError) as exc:  # bad input: a clear message, not a traceback
        print(f"kvstore: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
