"""Validated configuration dataclasses. Environment variables are read once, at start-up, by the
CLI; everything below receives plain values through its constructor."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shared.protocol import subjects

if TYPE_CHECKING:
    import torch

_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16"}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # by canonical name


def dtype_name(name: str) -> str:
    """The canonical name of a dtype ("bf16" → "bfloat16"), checked without importing torch."""
    try:
        return _DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(sorted(_DTYPES))}") from None


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    import torch  # here, not above: the gateway, the kvstore and `pdserve up` read this module, torch-free

    return name if isinstance(name, torch.dtype) else getattr(torch, dtype_name(name))


SPEC_MODES = ("off", "ngram", "suffix", "draft")


@dataclass
class SpecConfig:
    """Speculative decoding (shared/engine/speculative.py)."""

    mode: str = "suffix"  # off | ngram (prompt lookup) | suffix (+ earlier answers) | draft (a draft model)
    max_draft: int = 8  # most proposals verified per sequence and step
    ngram_min: int = 1  # shortest context matched
    ngram_max: int = 4  # longest context matched (tried first)
    draft_model: str | None = None  # checkpoint of the draft model (mode "draft")
    suffix_cache_tokens: int = 1 << 20  # tokens of earlier answers kept (mode "suffix")

    def __post_init__(self) -> None:
        if self.mode not in SPEC_MODES:
            raise ValueError(f"speculative mode must be one of {', '.join(SPEC_MODES)}, got {self.mode!r}")
        if self.max_draft < 1 or self.max_draft > 32:
            raise ValueError(f"speculative max_draft must be in [1, 32], got {self.max_draft}")
        if not 1 <= self.ngram_min <= self.ngram_max <= 16:
            raise ValueError(f"speculative n-gram range must satisfy 1 <= min <= max <= 16, got "
                             f"{self.ngram_min}..{self.ngram_max}")


@dataclass
class EngineConfig:
    model: str | None = None  # path, or None for the default model
    dtype: str = "float32"  # activations (and dense weights, with quantization "none")
    # "auto": the checkpoint's own weight blocks on pdserve's CPU kernel (float32 activations);
    # "none": dense weights in `dtype` (fp32: the exact evaluation of the file)
    quantization: str = "auto"
    kv_cache_dtype: str = "bfloat16"  # KV cache (and KV block) dtype
    device: str = "cpu"
    block_size: int = 16  # tokens per KV block (DESIGN.md contract)
    num_kv_blocks: int = 2048  # SmolLM2-135M bf16: 360 KiB a block → 720 MiB, 32k tokens
    max_num_seqs: int = 64  # running sequences per step
    max_num_batched_tokens: int = 512  # tokens per forward pass (the chunked-prefill budget)
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    max_model_len: int | None = None  # None: the checkpoint's context length
    num_threads: int | None = None  # torch intra-op threads (None: torch's default)
    # the compiled step: the fused C++ forward on the CPU, decode steps from CUDA graphs on CUDA; False: eager torch
    fused_forward: bool = True
    speculative: SpecConfig = field(default_factory=SpecConfig)

    def __post_init__(self) -> None:
        dtype_name(self.dtype)
        dtype_name(self.kv_cache_dtype)
        if self.quantization not in ("auto", "none"):
            raise ValueError(f"engine config: unknown quantization {self.quantization!r}; choose auto or none")
        for name in ("block_size", "num_kv_blocks", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"engine config: {name} must be positive, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"engine config: max_model_len must be positive, got {self.max_model_len}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)

    @property
    def torch_kv_dtype(self) -> torch.dtype:
        return parse_dtype(self.kv_cache_dtype)


@dataclass(kw_only=True)
class ConnectionConfig:
    """Where NATS and Valkey are, and how to log in: every service has these."""

    nats_url: str = "nats://127.0.0.1:4222"
    nats_user: str | None = None
    nats_password: str | None = None
    nats_token: str | None = None
    redis_url: str = "redis://127.0.0.1:6379"
    redis_password: str | None = None
    otlp_endpoint: str | None = None  # tracing (shared/telemetry/tracing.py): off when None
    trace_sample_ratio: float = 1.0


def pull_reserve(num_kv_blocks: int) -> int:
    """Free KV blocks a decode worker keeps for its running sequences to grow: it pulls a job only
    with more free than this (services/decode/worker.py, and the simulator's model of it)."""
    return max(8, num_kv_blocks // 8)


@dataclass(kw_only=True)
class WorkerConfig(ConnectionConfig):
    """What a prefill, decode or colocated worker needs besides its engine."""

    role: str  # "prefill" | "decode" | "colocated"
    instance: str
    engine: EngineConfig
    kvstore: str = "kv-local"  # the store on this host
    kv_use_shm: bool = True  # false: the network data path (another host, or tests)
    kv_failure_policy: str = "recompute"  # "recompute" the prompt here, or "fail" the request
    max_inflight: int = 4  # prefill: jobs taken at once (beyond that, they wait in the queue)
    # a job not acked by then is redelivered (its worker died holding it); a prefill keeps its job
    # alive with in_progress every ack_wait/3, a decode worker acks once the request is in its batch
    ack_wait_s: float = 10.0
    max_deliver: int = 3
    lease_ttl_s: float = 60.0  # how long KV blocks wait for a decode worker
    core_share: str | None = None  # file the engines of this host lend each other idle cores through
    core_slot: int = 0  # this worker's slot in it
    core_fair: bool = False  # its share: the host's cores divided among the workers present (else its threads)

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode", "colocated"):
            raise ValueError(f"worker role must be prefill, decode or colocated, got {self.role!r}")
        if self.kv_failure_policy not in ("recompute", "fail"):
            raise ValueError(f"kv_failure_policy must be recompute or fail, got {self.kv_failure_policy!r}")
        if self.max_inflight <= 0:
            raise ValueError("max_inflight must be positive")
        for name in ("instance", "kvstore"):  # both end up in NATS subjects
            subjects.check_token(getattr(self, name))
