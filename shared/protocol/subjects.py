"""NATS subjects, JetStream streams and Valkey keys, defined once.

    pd.prefill.jobs            JetStream PD_PREFILL (work queue): PrefillJob, any prefill (colocated) worker
    pd.prefill.jobs.<inst>     … for that worker only (the router chose it; the shared queue is the fallback)
    pd.decode.jobs             JetStream PD_DECODE (work queue): DecodeJob
    pd.decode.direct           JetStream PD_DECODE: PrefillJob that a decode worker runs itself
                               (conditional mode: short or mostly-cached prompts)
    pd.decode.direct.<inst>    … for that decode worker only
    pd.cache.events.<loc>      core NATS: CacheEvents of one prefix-caching location (routing index)
    pd.cache.sync.<loc>        core NATS request: that location's CacheSnapshot
    pd.tokens.<rid>            core NATS: TokenEvent, gateway subscribes per request
    pd.cancel.<rid>            core NATS: Cancel, every worker listens on pd.cancel.>
    pd.stats.<role>.<inst>     core NATS: WorkerStats, the gateway aggregates for /metrics
    pd.admin.reset_prefix_cache  core NATS request, answered by every worker and kvstore: ResetReply
    pd.kv.<store>.<op>         core NATS request/reply: kvstore control plane
                               (info, lookup, allocate, write, commit, read, release, renew, stats)
Valkey:
    pd:worker:<role>:<inst>    registry entry with TTL (heartbeat), value: encoded WorkerStats
    pd:kv:<key hex>            set of stores holding that block (routing hint, confirmed with the store)
    pd:cache:<loc>             CacheSnapshot of one location, with a TTL (a starting gateway's index)
"""

from __future__ import annotations

import re
import socket

PREFILL_STREAM = "PD_PREFILL"
DECODE_STREAM = "PD_DECODE"

PREFILL_JOBS = "pd.prefill.jobs"
DECODE_JOBS = "pd.decode.jobs"
DECODE_DIRECT = "pd.decode.direct"

CANCEL_ALL = "pd.cancel.>"
RESET_PREFIX_CACHE = "pd.admin.reset_prefix_cache"
# a gateway back on NATS after an outage asks every worker to send again the token events of the
# last seconds (core NATS dropped what was published while it was away; it drops duplicates)
REPLAY_TOKENS = "pd.admin.replay_tokens"
STATS_ALL = "pd.stats.>"

CACHE_EVENTS_ALL = "pd.cache.events.>"
CACHE_SNAPSHOT_PATTERN = "pd:cache:*"

KV_OPS = ("info", "lookup", "allocate", "write", "commit", "read", "release", "renew", "stats")


def tokens(request_id: str) -> str:
    return f"pd.tokens.{request_id}"


def cancel(request_id: str) -> str:
    return f"pd.cancel.{request_id}"


def stats(role: str, instance: str) -> str:
    return f"pd.stats.{role}.{instance}"


def worker_jobs(base: str, instance: str) -> str:
    """The per-worker job subject under `base` (PREFILL_JOBS or DECODE_DIRECT)."""
    return f"{base}.{check_token(instance)}"


def cache_location(kind: str, name: str) -> str:
    """The routing index's name for a worker's engine cache ("worker") or a host's kvstore ("store")."""
    return f"{kind}.{check_token(name)}"


def cache_events(location: str) -> str:
    return f"pd.cache.events.{location}"


def cache_sync(location: str) -> str:
    return f"pd.cache.sync.{location}"


def cache_snapshot_key(location: str) -> str:
    return f"pd:cache:{location}"


def host_token() -> str:
    """This host's name as one subject token (a dotted FQDN would not be): default instance and
    kvstore names are made from it."""
    return re.sub(r"[^A-Za-z0-9_\-]", "-", socket.gethostname())


def check_token(name: str) -> str:
    """`name` as one NATS subject token (instance and store names end up in subjects)."""
    if not name or any(c in name for c in ".*> \t\r\n"):
        raise ValueError(f"{name!r} cannot be part of a NATS subject: no dots, wildcards or spaces")
    return name


def kv(store: str, op: str) -> str:
    if op not in KV_OPS:
        raise ValueError(f"unknown kvstore operation {op!r}")
    return f"pd.kv.{store}.{op}"


def registry_key(role: str, instance: str) -> str:
    return f"pd:worker:{role}:{instance}"


REGISTRY_PATTERN = "pd:worker:*"


def block_index_key(key: bytes) -> str:
    return f"pd:kv:{key.hex()}"
