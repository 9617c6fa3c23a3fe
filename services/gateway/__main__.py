"""`python -m services.gateway`: the OpenAI-compatible HTTP front of pdserve.

Environment variables are read here, once (flags win over them), and become a GatewayConfig.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys

from services.gateway.config import MODES, ROUTERS, GatewayConfig
from services.gateway.cost import Price
from services.gateway.server import serve
from shared.cli_args import add_connection_args, connection_fields
from shared.telemetry import tracing


def build_parser() -> argparse.ArgumentParser:
    env = os.environ.get
    defaults = GatewayConfig()
    p = argparse.ArgumentParser(prog="python -m services.gateway", description=__doc__.splitlines()[0])
    p.add_argument("--host", default=env("PDSERVE_GATEWAY_HOST", defaults.host))
    p.add_argument("--port", type=int, default=int(env("PDSERVE_GATEWAY_PORT", defaults.port)))
    p.add_argument("--instance", default=env("PDSERVE_INSTANCE", f"gateway-{socket.gethostname()}"),
                   help="this gateway's label in /metrics")
    add_connection_args(p)  # --nats, --redis and their credentials, as every service takes them
    p.add_argument("--model", default=env("PDSERVE_MODEL"),
                   help="GGUF file or Hugging Face model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", default=env("PDSERVE_SERVED_MODEL_NAME"))
    p.add_argument("--max-model-len", type=int, default=_int_or_none(env("PDSERVE_MAX_MODEL_LEN")))
    p.add_argument("--mode", choices=MODES, default=env("PDSERVE_MODE", defaults.mode))
    p.add_argument("--conditional-threshold", type=int,
                   default=int(env("PDSERVE_CONDITIONAL_THRESHOLD", defaults.conditional_threshold)))
    p.add_argument("--conditional-busy-threshold", type=int,
                   default=int(env("PDSERVE_CONDITIONAL_BUSY_THRESHOLD", defaults.conditional_busy_threshold)),
                   help="conditional mode: uncached prompts up to this long also go to decode while the prefill "
                        "queue holds more than --conditional-queue-tokens")
    p.add_argument("--conditional-queue-tokens", type=int,
                   default=int(env("PDSERVE_CONDITIONAL_QUEUE_TOKENS", defaults.conditional_queue_tokens)))
    p.add_argument("--router", choices=ROUTERS, default=env("PDSERVE_ROUTER", defaults.router),
                   help="how each job's worker is chosen (default: cache-aware: fewest blocks left to compute "
                        "plus load, with a hot-spot guard)")
    p.add_argument("--hot-spot-factor", type=float,
                   default=float(env("PDSERVE_HOT_SPOT_FACTOR", defaults.hot_spot_factor)),
                   help="cache-aware: a worker loaded above the mean by this factor is not chosen for its cache")
    p.add_argument("--max-concurrent-requests", type=int,
                   default=int(env("PDSERVE_MAX_CONCURRENT_REQUESTS", defaults.max_concurrent_requests)))
    p.add_argument("--max-body-bytes", type=int, default=int(env("PDSERVE_MAX_BODY_BYTES", defaults.max_body_bytes)))
    p.add_argument("--default-max-tokens", type=int,
                   default=int(env("PDSERVE_DEFAULT_MAX_TOKENS", defaults.default_max_tokens)))
    p.add_argument("--queue-timeout", type=float, default=float(env("PDSERVE_QUEUE_TIMEOUT", defaults.queue_timeout_s)),
                   help="seconds a request may wait for a worker to take its job")
    p.add_argument("--inactivity-timeout", type=float,
                   default=float(env("PDSERVE_INACTIVITY_TIMEOUT", defaults.inactivity_timeout_s)))
    p.add_argument("--max-migrations", type=int,
                   default=int(env("PDSERVE_MAX_MIGRATIONS", defaults.max_migrations)),
                   help="resubmit a dead decode worker's request this often (0: fail it at once)")
    p.add_argument("--request-timeout", type=float,
                   default=float(env("PDSERVE_REQUEST_TIMEOUT", defaults.request_timeout_s)))
    p.add_argument("--shutdown-grace", type=float,
                   default=float(env("PDSERVE_SHUTDOWN_GRACE", defaults.shutdown_grace_s)),
                   help="on SIGTERM, open streams get this long to complete; then each ends with an error event")
    p.add_argument("--api-key", default=env("PDSERVE_API_KEY"))
    p.add_argument("--log-level", default=env("PDSERVE_LOG_LEVEL", defaults.log_level))
    p.add_argument("--price", default=env("PDSERVE_PRICE", ""), type=_price, metavar="prefill=P,decode=D,gb=G,currency=C",
                   help="price per prefill-second, per decode-second and per GB of KV moved (usage.cost, "
                        "pdserve_cost_total)")
    p.add_argument("--expect", default=env("PDSERVE_EXPECT", ""), type=_role_counts, metavar="ROLE=N,...",
                   help="instances the deployment starts, e.g. prefill=1,decode=2,kvstore=1: /health is 503 "
                        "(starting) until each has reported once")
    return p


def _role_counts(text: str) -> dict[str, int]:
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        role, sep, n = part.partition("=")
        if not sep or not n.strip().isdigit():
            raise argparse.ArgumentTypeError(f"expected ROLE=N, got {part!r}")
        out[role.strip()] = int(n)
    return out


def _price(text: str) -> Price:
    try:
        return Price.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _int_or_none(value: str | None) -> int | None:
    return int(value) if value else None


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    return GatewayConfig(
        host=args.host, port=args.port, instance=args.instance, **connection_fields(args), model=args.model,
        served_model_name=args.served_model_name,
        max_model_len=args.max_model_len, mode=args.mode, conditional_threshold=args.conditional_threshold,
        conditional_busy_threshold=args.conditional_busy_threshold,
        conditional_queue_tokens=args.conditional_queue_tokens, router=args.router,
        hot_spot_factor=args.hot_spot_factor,
        max_concurrent_requests=args.max_concurrent_requests, max_body_bytes=args.max_body_bytes,
        default_max_tokens=args.default_max_tokens, inactivity_timeout_s=args.inactivity_timeout, queue_timeout_s=args.queue_timeout,
        max_migrations=args.max_migrations,
        request_timeout_s=args.request_timeout, shutdown_grace_s=args.shutdown_grace, api_key=args.api_key,
        log_level=args.log_level, expect=args.expect, price=args.price,
    )


async def _run(config: GatewayConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)  # signal → Event → stop taking work → drain → close
    tracing.setup("gateway", config.instance, config.otlp_endpoint, config.trace_sample_ratio)
    try:
        await serve(config, stop)
    finally:
        tracing.shutdown()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(_run(config_from_args(args)))
    except (ValueError, RuntimeError, FileNotFoundError) as exc:
        print(f"gateway: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
