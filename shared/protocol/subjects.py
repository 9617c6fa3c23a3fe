"""NATS subjects, JetStream streams and Valkey keys, defined once.

    pd.prefill.jobs            JetStream PD_PREFILL (work queue): PrefillJob
    pd.decode.jobs             JetStream PD_DECODE (work queue): DecodeJob
    pd.decode.direct           JetStream PD_DECODE: PrefillJob that a decode worker runs itself
                               (conditional mode: short prompts)
    pd.tokens.<rid>            core NATS: TokenEvent, gateway subscribes per request
    pd.cancel.<rid>            core NATS: Cancel, every worker listens on pd.cancel.>
    pd.stats.<role>.<inst>     core NATS: WorkerStats, the gateway aggregates for /metrics
    pd.admin.reset_prefix_cache  core NATS request, answered by every worker and kvstore: ResetReply
    pd.kv.<store>.<op>         core NATS request/reply: kvstore control plane
                               (info, lookup, allocate, write, commit, read, release, renew, stats)
Valkey:
    pd:worker:<role>:<inst>    registry entry with TTL (heartbeat), value: encoded WorkerStats
    pd:kv:<key hex>            set of stores holding that block (routing hint, confirmed with the store)
"""

from __future__ import annotations

PREFILL_STREAM = "PD_PREFILL"
DECODE_STREAM = "PD_DECODE"

PREFILL_JOBS = "pd.prefill.jobs"
DECODE_JOBS = "pd.decode.jobs"
DECODE_DIRECT = "pd.decode.direct"

CANCEL_ALL = "pd.cancel.>"
RESET_PREFIX_CACHE = "pd.admin.reset_prefix_cache"
STATS_ALL = "pd.stats.>"

KV_OPS = ("info", "lookup", "allocate", "write", "commit", "read", "release", "renew", "stats")


def tokens(request_id: str) -> str:
    return f"pd.tokens.{request_id}"


def cancel(request_id: str) -> str:
    return f"pd.cancel.{request_id}"


def stats(role: str, instance: str) -> str:
    return f"pd.stats.{role}.{instance}"


def kv(store: str, op: str) -> str:
    if op not in KV_OPS:
        raise ValueError(f"unknown kvstore operation {op!r}")
    return f"pd.kv.{store}.{op}"


def registry_key(role: str, instance: str) -> str:
    return f"pd:worker:{role}:{instance}"


REGISTRY_PATTERN = "pd:worker:*"


def block_index_key(key: bytes) -> str:
    return f"pd:kv:{key.hex()}"
