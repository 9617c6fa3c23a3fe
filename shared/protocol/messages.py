"""Every message that crosses a process boundary: typed msgspec Structs, MessagePack on the wire.

Rules: each message carries `v` (the protocol version) and is decoded into the type the receiver
expects (`decode(data, PrefillJob)`), never into a dict. Token ids travel, not text. KV bytes travel
as raw `bytes` fields or through shared memory, never pickled. Errors are data: an `ErrorCode` and a
message. Unknown fields are ignored on decode so a newer sender can add optional fields.
"""

from __future__ import annotations

import enum
from typing import TypeVar

import msgspec

PROTOCOL_VERSION = 1


class ErrorCode(enum.IntEnum):
    OK = 0
    BAD_REQUEST = 1  # the request itself is invalid (too long, bad ids)
    OVERLOADED = 2  # no capacity now; try later
    KV_TRANSFER_FAILED = 3  # blocks missing/evicted/corrupt and the policy is to fail
    WORKER_LOST = 4  # the worker holding the request died and migration is exhausted
    TIMEOUT = 5  # deadline or inactivity timeout
    CANCELLED = 6
    INTERNAL = 7
    UNAVAILABLE = 8  # the service is stopping, or a part it needs (NATS) is unreachable: retry later


class Msg(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    v: int = PROTOCOL_VERSION


class ConstraintMsg(msgspec.Struct, kw_only=True):
    """Structured output: the text the model may write, enforced token by token in decode.

    kind "json": a JSON value matching `spec` (a JSON Schema as JSON text; "" = any JSON object);
    "regex": text matching the regular expression `spec`; "choice": exactly one of `choices`;
    "grammar": text of the Lark/EBNF grammar `spec`."""

    kind: str
    spec: str = ""
    choices: list[str] = []


class SamplingMsg(msgspec.Struct, kw_only=True):
    """Wire form of `shared.model.sampling.SamplingParams` (validated again on arrival)."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = {}
    min_p: float = 0.0
    logprobs: int | None = None  # per output token: its log-probability and the top `logprobs`
    constraint: ConstraintMsg | None = None  # structured output (None: free text)
    prompt_logprobs: int | None = None  # per prompt token after the first (echo + logprobs); no prefix cache


class TokenLogprobs(msgspec.Struct, array_like=True):
    """One output token's log-probability and the most likely tokens' (most likely first)."""

    logprob: float
    top_ids: list[int] = []
    top_logprobs: list[float] = []


class Timing(msgspec.Struct, kw_only=True):
    """Per-request breakdown, seconds (monotonic clocks differ across hosts: only durations travel)."""

    queue_s: float = 0.0  # gateway publish → a prefill worker took the job
    prefill_s: float = 0.0  # prefill compute (including waiting for a batch slot)
    kv_write_s: float = 0.0  # prefill → kvstore
    decode_queue_s: float = 0.0  # DecodeJob published → a decode worker took it
    kv_read_s: float = 0.0  # kvstore → an engine's cache (prefill's prefix hits + decode's prompt)
    decode_s: float = 0.0  # first decode step → finish
    # cost accounting (services/gateway/cost.py): engine step time charged to this request's prompt
    # chunks and decode rows (each step shared by the rows each request ran), and the KV bytes moved
    prefill_compute_s: float = 0.0
    decode_compute_s: float = 0.0
    prefill_core_s: float = 0.0  # the same, times the compute units of each step (CPU threads; a GPU: 1)
    decode_core_s: float = 0.0
    kv_bytes_written: int = 0  # prefill → kvstore
    kv_bytes_read: int = 0  # kvstore → prefill (prefix hits) and → decode


class PrefillJob(Msg, kw_only=True):
    request_id: str
    prompt_ids: list[int]
    params: SamplingMsg
    # tokens already streamed to the client (a migrated request resumes after them)
    resume_ids: list[int] = []
    created_at: float = 0.0  # unix time the gateway published it (for queue time)
    deadline: float = 0.0  # unix time after which nobody should work on it (0: none)
    attempt: int = 0


class KVBlockRef(msgspec.Struct, array_like=True):
    slot: int  # index in the kvstore's pool
    checksum: int  # XXH3-64 of the block's bytes, checked by the reader


class DecodeJob(Msg, kw_only=True):
    request_id: str
    token_ids: list[int]  # prompt (+ resumed tokens): exactly the tokens whose KV the blocks hold
    first_token: int  # sampled by the prefill worker; already sent to the client
    params: SamplingMsg
    store: str  # kvstore instance holding the blocks
    lease_id: str  # release it once the blocks are copied
    blocks: list[KVBlockRef]  # ceil(len(token_ids) / 16) blocks, the last maybe partial
    segment: str = ""  # the store's shared-memory segment holding them: read only from that one
    num_cached_tokens: int = 0  # prompt tokens the prefill worker found in the prefix cache
    num_prompt_tokens: int = 0  # of the original prompt (token_ids may include resumed tokens)
    num_resumed: int = 0  # tokens already streamed before this attempt
    created_at: float = 0.0
    deadline: float = 0.0
    attempt: int = 0
    timing: Timing = msgspec.field(default_factory=Timing)
    # decode workers that had no room for its blocks and put it back in the queue for one that has
    # (each does so once: a worker it comes back to waits for room with it)
    handed_back: list[str] = []


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    draft_tokens: int = 0  # speculative decoding: proposals verified for this request
    accepted_tokens: int = 0  # of them, kept (each one a token that needed no step of its own)


class TokenEvent(Msg, kw_only=True):
    """One or more new tokens of a request, or its end. `index` is the position of token_ids[0]
    in the request's output, so receivers drop duplicates and detect gaps."""

    request_id: str
    index: int
    token_ids: list[int] = []
    logprobs: list[TokenLogprobs] = []  # one per token id, where the request asked for them
    # on the first event of a request that asked for them: prompt tokens 1 … P-1's, each given the
    # tokens before it (token 0 has none)
    prompt_logprobs: list[TokenLogprobs] = []
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None
    usage: Usage | None = None
    timing: Timing | None = None
    error_code: ErrorCode = ErrorCode.OK
    error: str = ""
    worker: str = ""  # instance that produced it (for migration and debugging)
    attempt: int = 0  # the job attempt it belongs to; the gateway drops events of replaced attempts
    # the request waits in a queue again until its next event: a prefill worker handed its DecodeJob
    # to the decode pool's queue (the gateway waits its queue timeout, not its inactivity timeout)
    queued: bool = False


class Cancel(Msg, kw_only=True):
    request_id: str
    reason: str = "client disconnected"
    # cancel this attempt and the earlier ones only (a migration cancels the attempt it replaces,
    # which a hung worker may still hold); -1: every attempt
    attempt: int = -1


class WorkerStats(Msg, kw_only=True):
    """Published every heartbeat by every worker and the kvstore; the gateway re-exports them."""

    role: str  # "prefill" | "decode" | "colocated" | "kvstore"
    instance: str
    running: int = 0
    waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_in_use: int = 0
    kv_blocks_cached: int = 0
    prefix_queries: int = 0  # blocks looked up
    prefix_hits: int = 0  # blocks found
    free_slots: int = 0  # how many more requests it would take now
    # speculative decoding, cumulative (vLLM's spec_decode counters)
    spec_drafts: int = 0  # sequence-steps that verified proposals
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = []  # [i]: drafts whose proposal i was kept
    busy_s: float = 0.0  # cumulative engine step time (all of it charged to requests: cost accounting)
    busy_core_s: float = 0.0  # … times each step's compute units (CPU threads)
    kvstore: str = ""  # a worker: the store of its host (the router counts that store's prefixes as its own)
    queued_tokens: int = 0  # prompt tokens taken but not yet computed (the router's prefill load)
    draining: bool = False  # stopping: takes no new jobs (the router sends it none)
    ts: float = 0.0


class CacheEvents(Msg, kw_only=True):
    """What changed in one place that caches prefixes (a worker's engine, a host's kvstore), on
    pd.cache.events.<location>: the routing index of every gateway follows it.

    `seq` counts the batches of one `epoch` (a process lifetime) from 1; a batch with nothing in it
    repeats the last seq (a keepalive). A gap or a new epoch sends the reader to the snapshot."""

    location: str  # "worker.<instance>" | "store.<store>"
    epoch: str
    seq: int
    stored: list[bytes] = []  # block keys that can now be hit here
    evicted: list[bytes] = []  # block keys that no longer can
    gone: bool = False  # the location is shutting down: forget it


class CacheSnapshot(Msg, kw_only=True):
    """Every key of one location as of batch `seq` (events after `seq` apply on top): in Valkey at
    pd:cache:<location> (with a TTL), and the reply to pd.cache.sync.<location>."""

    location: str
    epoch: str
    seq: int
    keys: list[bytes] = []


class ResetReply(Msg, kw_only=True):
    """A worker's or kvstore's answer to pd.admin.reset_prefix_cache: its cached blocks are forgotten."""

    role: str
    instance: str
    blocks: int = 0  # cached blocks forgotten


# ------------------------------------------------------------------------------------- kvstore RPC


class KVLookup(Msg, kw_only=True):
    keys: list[bytes]  # block keys of the prompt's full blocks, in order
    lease_ttl_s: float = 30.0  # hits are leased for the reader


class KVLookupReply(Msg, kw_only=True):
    lease_id: str = ""  # "" when nothing was found
    blocks: list[KVBlockRef] = []  # the longest cached prefix of `keys`
    segment: str = ""  # the store's shared-memory segment the slots are in (a restarted store has a new one)
    error_code: ErrorCode = ErrorCode.OK
    error: str = ""


class KVAllocate(Msg, kw_only=True):
    num_blocks: int
    lease_ttl_s: float = 30.0
    lease_id: str = ""  # extend this lease (e.g. the one a lookup returned) instead of a new one


class KVAllocateReply(Msg, kw_only=True):
    lease_id: str = ""
    slots: list[int] = []
    segment: str = ""  # as in KVLookupReply
    error_code: ErrorCode = ErrorCode.OK
    error: str = ""


class KVCommit(Msg, kw_only=True):
    """The writer filled the slots of its lease; `keys[i]` names slots[i] (b"" for a partial block,
    which is kept under the lease but never indexed)."""

    lease_id: str
    slots: list[int]
    keys: list[bytes]
    checksums: list[int]


class KVRead(Msg, kw_only=True):
    """Network data path: ask for blocks' bytes, answered in chunks below max_payload."""

    lease_id: str
    slots: list[int]


class KVReadChunk(Msg, kw_only=True):
    slot: int
    offset: int
    data: bytes
    last: bool = False
    error_code: ErrorCode = ErrorCode.OK
    error: str = ""


class KVWriteChunk(Msg, kw_only=True):
    """Network data path, writer side: part of a slot's bytes (request; answered with KVReply)."""

    lease_id: str
    slot: int
    offset: int
    data: bytes


class KVRelease(Msg, kw_only=True):
    lease_id: str


class KVRenew(Msg, kw_only=True):
    lease_id: str
    lease_ttl_s: float = 30.0


class KVReply(Msg, kw_only=True):
    """Generic acknowledgement for commit / release / renew."""

    error_code: ErrorCode = ErrorCode.OK
    error: str = ""


class KVStoreInfo(Msg, kw_only=True):
    """What a worker needs to attach to a store (answered on pd.kv.<store>.info)."""

    store: str
    shm_name: str  # POSIX shared memory segment ("" if none: network path only)
    num_slots: int
    block_bytes: int
    block_size: int
    layout: str  # e.g. "L30.2.16.H3.D64.bfloat16": must match the worker's model
    max_payload: int


# --------------------------------------------------------------------------------------- encoding

_encoder = msgspec.msgpack.Encoder()
T = TypeVar("T")


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes, type_: type[T]) -> T:
    """Decode into the expected type; raises `msgspec.DecodeError`/`ValidationError` on bad input."""
    return msgspec.msgpack.decode(data, type=type_)
