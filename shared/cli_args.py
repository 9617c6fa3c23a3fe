"""Command-line arguments shared by the service entry points (read once at start-up; environment
variables give the defaults, so docker-compose can configure services without flags)."""

from __future__ import annotations

import argparse
import os

from shared.config import SPEC_MODES, EngineConfig, SpecConfig, WorkerConfig
from shared.protocol import subjects


def env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(name, default)


def add_connection_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nats", default=env("PDSERVE_NATS_URL", "nats://127.0.0.1:4222"), help="NATS URL")
    p.add_argument("--nats-user", default=env("PDSERVE_NATS_USER"))
    p.add_argument("--nats-password", default=env("PDSERVE_NATS_PASSWORD"))
    p.add_argument("--nats-token", default=env("PDSERVE_NATS_TOKEN"))
    p.add_argument("--redis", default=env("PDSERVE_REDIS_URL", "redis://127.0.0.1:6379"), help="Valkey/Redis URL")
    p.add_argument("--redis-password", default=env("PDSERVE_REDIS_PASSWORD"))
    p.add_argument("--otlp-endpoint", default=env("PDSERVE_OTLP_ENDPOINT"),
                   help="export traces over OTLP/HTTP to this collector (…/v1/traces is appended); off if unset")
    p.add_argument("--trace-sample-ratio", type=float, default=float(env("PDSERVE_TRACE_SAMPLE_RATIO", "1.0")),
                   help="fraction of requests traced (decided at the gateway; the services follow)")


def connection_fields(args: argparse.Namespace) -> dict:
    """The ConnectionConfig fields from `add_connection_args`'s options."""
    return dict(nats_url=args.nats, nats_user=args.nats_user, nats_password=args.nats_password,
                nats_token=args.nats_token, redis_url=args.redis, redis_password=args.redis_password,
                otlp_endpoint=args.otlp_endpoint, trace_sample_ratio=args.trace_sample_ratio)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=env("PDSERVE_MODEL"),
                   help="GGUF file or Hugging Face model directory (default: SmolLM2-135M-Instruct, pulled on demand)")
    p.add_argument("--dtype", default=env("PDSERVE_DTYPE", "float32"),
                   help="activations: float32 (the CPU default) | bfloat16 (dense weights, e.g. on CUDA)")
    p.add_argument("--quantization", default=env("PDSERVE_QUANTIZATION", "auto"), choices=["auto", "none"],
                   help="auto: the checkpoint's own weight blocks (Q4_1, Q8_0) on pdserve's CPU kernel; "
                        "none: dense weights in --dtype")
    p.add_argument("--kv-dtype", default=env("PDSERVE_KV_DTYPE", "bfloat16"),
                   help="KV cache dtype: bfloat16 | float16 | float32 (the kvstore must use the same)")
    p.add_argument("--device", default=env("PDSERVE_DEVICE", "cpu"))
    p.add_argument("--threads", type=int, default=int(env("PDSERVE_THREADS", "0")) or None,
                   help="torch intra-op threads")
    p.add_argument("--num-kv-blocks", type=int, default=int(env("PDSERVE_NUM_KV_BLOCKS", "2048")))
    p.add_argument("--max-num-seqs", type=int, default=int(env("PDSERVE_MAX_NUM_SEQS", "64")))
    p.add_argument("--max-num-batched-tokens", type=int, default=int(env("PDSERVE_MAX_NUM_BATCHED_TOKENS", "512")))
    p.add_argument("--no-chunked-prefill", action="store_true")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--no-compile", action="store_true", default=env("PDSERVE_NO_COMPILE") == "1",
                   help="eager torch ops instead of the compiled step: the fused C++ forward over the same weight "
                        "blocks on the CPU, decode steps replayed from CUDA graphs on CUDA (slower; for debugging)")
    add_speculative_args(p)


def add_speculative_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative", default=env("PDSERVE_SPECULATIVE", "suffix"), choices=SPEC_MODES,
                   help="speculative decoding: suffix (the request's own text and earlier answers, the default), "
                        "ngram (the request's own text), draft (a draft model), off. Output is the same as off; "
                        "how much is proposed adapts to acceptance and batch size")
    p.add_argument("--speculative-max-draft", type=int, default=int(env("PDSERVE_SPECULATIVE_MAX_DRAFT", "8")),
                   help="most tokens proposed per sequence and step")
    p.add_argument("--speculative-ngram", default=env("PDSERVE_SPECULATIVE_NGRAM", "1:4"),
                   help="MIN:MAX tokens of context matched by the n-gram proposers")
    p.add_argument("--speculative-draft-model", default=env("PDSERVE_SPECULATIVE_DRAFT_MODEL"),
                   help="draft model checkpoint (same vocabulary) for --speculative draft")


def speculative_config(args: argparse.Namespace) -> SpecConfig:
    try:
        lo, hi = (int(x) for x in args.speculative_ngram.split(":"))
    except ValueError:
        raise ValueError(f"--speculative-ngram must be MIN:MAX, got {args.speculative_ngram!r}") from None
    return SpecConfig(mode=args.speculative, max_draft=args.speculative_max_draft, ngram_min=lo, ngram_max=hi,
                      draft_model=args.speculative_draft_model)


def speculative_argv(args: argparse.Namespace) -> list[str]:
    """The speculative options as worker arguments (`pdserve up` passes them on)."""
    argv = ["--speculative", args.speculative, "--speculative-max-draft", str(args.speculative_max_draft),
            "--speculative-ngram", args.speculative_ngram]
    if args.speculative_draft_model:
        argv += ["--speculative-draft-model", args.speculative_draft_model]
    return argv


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, num_threads=args.threads,
        quantization=args.quantization, kv_cache_dtype=args.kv_dtype,
        num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_chunked_prefill=not args.no_chunked_prefill, enable_prefix_caching=not args.no_prefix_caching,
        fused_forward=not args.no_compile, speculative=speculative_config(args),
    )


def add_worker_args(p: argparse.ArgumentParser) -> None:
    add_connection_args(p)
    add_engine_args(p)
    p.add_argument("--instance", default=env("PDSERVE_INSTANCE"), help="unique name (default: host-pid)")
    p.add_argument("--kvstore", default=env("PDSERVE_KVSTORE", f"kv-{subjects.host_token()}"),
                   help="name of this host's kvstore")
    p.add_argument("--kv-network", action="store_true", default=env("PDSERVE_KV_NETWORK") == "1",
                   help="move KV over NATS instead of shared memory (a store on another host)")
    p.add_argument("--kv-failure-policy", default=env("PDSERVE_KV_FAILURE_POLICY", "recompute"),
                   choices=["recompute", "fail"])
    p.add_argument("--max-inflight", type=int, default=int(env("PDSERVE_MAX_INFLIGHT", "4")))
    p.add_argument("--ack-wait", type=float, default=float(env("PDSERVE_ACK_WAIT", "10")))
    p.add_argument("--max-deliver", type=int, default=int(env("PDSERVE_MAX_DELIVER", "3")))
    p.add_argument("--lease-ttl", type=float, default=float(env("PDSERVE_LEASE_TTL", "60")),
                   help="seconds a request's KV blocks stay leased in the kvstore if no one releases them")
    p.add_argument("--core-share", default=env("PDSERVE_CORE_SHARE"),
                   help="file through which the engines of this host lend each other their cores while idle "
                        "(pdserve up sets it); this worker's own share is --threads")
    p.add_argument("--core-slot", type=int, default=int(env("PDSERVE_CORE_SLOT", "0")),
                   help="this worker's slot in --core-share (unique per worker on the host)")
    p.add_argument("--fair-share", action="store_true", default=env("PDSERVE_FAIR_SHARE", "") == "1",
                   help="with --core-share: this worker's share is the host's cores divided among the workers "
                        "present, as they come and go (pdserve up's default); --threads is then its first steps'")


def worker_config(args: argparse.Namespace, role: str) -> WorkerConfig:
    engine = engine_config(args)
    if role == "prefill":  # it samples one token per request: nothing to speculate on
        engine.speculative = SpecConfig(mode="off")
    return WorkerConfig(
        role=role, instance=args.instance or f"{role}-{subjects.host_token()}-{os.getpid()}",
        engine=engine, **connection_fields(args), kvstore=args.kvstore, kv_use_shm=not args.kv_network,
        kv_failure_policy=args.kv_failure_policy, max_inflight=args.max_inflight, ack_wait_s=args.ack_wait,
        max_deliver=args.max_deliver, lease_ttl_s=args.lease_ttl, core_share=args.core_share,
        core_slot=args.core_slot, core_fair=args.fair_share,
    )
