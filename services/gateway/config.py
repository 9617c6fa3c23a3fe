"""The gateway's configuration: one validated dataclass, filled from argv/env by `__main__` only."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.gateway.cost import Price
from shared.config import ConnectionConfig

MODES = ("disaggregated", "colocated", "conditional")
ROUTERS = ("cache-aware", "least-loaded", "round-robin")  # services/gateway/router.py

# The worker roles that must be alive before a mode can serve a request (DESIGN.md "Modes").
REQUIRED_ROLES: dict[str, frozenset[str]] = {
    "disaggregated": frozenset({"prefill", "decode"}),
    "colocated": frozenset({"colocated"}),
    "conditional": frozenset({"prefill", "decode"}),
}


@dataclass(kw_only=True)
class GatewayConfig(ConnectionConfig):
    host: str = "127.0.0.1"
    port: int = 8000
    instance: str = "gateway-0"  # label of the gateway's own rows in /metrics


    model: str | None = None  # GGUF file or HF directory; None: the default model (pulled on demand)
    served_model_name: str | None = None  # None: the default model's id, else the file/directory name
    max_model_len: int | None = None  # None: the checkpoint's context length

    mode: str = "disaggregated"
    # conditional mode, decided per request from the prompt's *uncached* tokens (services/gateway/router.py):
    # fewer than this go straight to a decode worker, which prefills them itself …
    conditional_threshold: int = 256
    # … and so do up to `conditional_busy_threshold` when the prefill pool already has more than
    # `conditional_queue_tokens` prompt tokens queued (its queue would cost more than computing here)
    conditional_busy_threshold: int = 1024
    conditional_queue_tokens: int = 4096
    router: str = "cache-aware"  # how a job's worker is chosen: cache-aware | least-loaded | round-robin
    # cache-aware: a worker whose load is above the mean by this factor is not chosen for its cache
    hot_spot_factor: float = 1.5

    max_concurrent_requests: int = 256  # in flight in this gateway; beyond it → 429
    max_body_bytes: int = 4 * 1024 * 1024  # request bodies above it → 413
    default_max_tokens: int = 1024  # cap on max_tokens when a request leaves it out
    inactivity_timeout_s: float = 60.0  # no TokenEvent for this long → error, Cancel published
    # a job no worker has taken yet is queued, not stalled: it waits this long for one (bounded by
    # the deadline), so a burst of long prompts queues behind the prefill pool instead of failing
    queue_timeout_s: float = 300.0
    max_migrations: int = 2  # a dead decode worker's request is resubmitted this often, then fails
    worker_dead_s: float = 3.0  # no heartbeat from the worker streaming a request for this long: dead
    request_timeout_s: float = 600.0  # overall deadline (also PrefillJob.deadline)
    publish_timeout_s: float = 5.0  # JetStream publish ack
    worker_alive_s: float = 5.0  # a WorkerStats this recent counts as alive (/health)
    worker_stats_ttl_s: float = 10.0  # /metrics drops instances silent for longer
    registry_cache_s: float = 1.0  # how long one Valkey registry scan is reused
    shutdown_grace_s: float = 10.0  # on shutdown open streams get this long, then end with an error event

    api_key: str | None = None  # if set, /v1/* needs "Authorization: Bearer <api_key>"
    # instances per role the deployment starts (`pdserve up` passes them): /health says "starting"
    # (503) until each has been heard from once; after that, one live instance of each needed role
    expect: dict[str, int] = field(default_factory=dict)
    log_level: str = "info"
    price: Price = field(default_factory=Price)  # per prefill-second, decode-second, GB of KV moved

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"gateway config: mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"gateway config: port must be in [0, 65535], got {self.port}")
        if self.router not in ROUTERS:
            raise ValueError(f"gateway config: router must be one of {', '.join(ROUTERS)}, got {self.router!r}")
        if not self.hot_spot_factor >= 1.0:
            raise ValueError(f"gateway config: hot_spot_factor must be >= 1, got {self.hot_spot_factor}")
        for name in ("max_concurrent_requests", "max_body_bytes", "default_max_tokens", "conditional_threshold",
                     "conditional_busy_threshold", "conditional_queue_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"gateway config: {name} must be positive, got {getattr(self, name)}")
        for name in ("inactivity_timeout_s", "queue_timeout_s", "request_timeout_s", "publish_timeout_s", "worker_alive_s",
                     "worker_stats_ttl_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"gateway config: {name} must be positive, got {getattr(self, name)}")
        if self.max_migrations < 0 or not self.worker_dead_s > 0:
            raise ValueError("gateway config: max_migrations must be >= 0 and worker_dead_s > 0")
        if self.registry_cache_s < 0 or self.shutdown_grace_s < 0:
            raise ValueError("gateway config: registry_cache_s and shutdown_grace_s must be >= 0")
        if self.max_model_len is not None and self.max_model_len <= 1:
            raise ValueError(f"gateway config: max_model_len must be > 1, got {self.max_model_len}")
        if not self.instance:
            raise ValueError("gateway config: instance must be a non-empty name")
        if any(n < 0 for n in self.expect.values()):
            raise ValueError(f"gateway config: expected instance counts must be >= 0, got {self.expect}")
        if self.api_key == "":
            self.api_key = None

    @property
    def required_roles(self) -> frozenset[str]:
        return REQUIRED_ROLES[self.mode]
