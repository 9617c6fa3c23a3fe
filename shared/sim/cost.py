"""Step and transfer times, from a profile file (`pdserve profile` writes one; see profile.py).

The model of one engine step is linear in what the step does (fitted by least squares on measured
steps, so it moves with the engine: re-profile and the simulator follows):

    prefill part  base + per_token·T + per_attn_pair·A + per_seq·S
                  T = new prompt tokens in the step, S = sequences with a chunk,
                  A = Σ n_i·(s_i + n_i/2): query×key pairs of causal attention (chunk of n_i at offset s_i)
    decode part   base + per_seq·B + per_ctx_token·C
                  B = sequences decoding one token, C = Σ their context lengths (KV read per step)
    mixed step    a prompt's chunk with decode rows riding on it: one forward pass at prefill rates, each
                  decode row also reading its KV as a decode step does (`riding_decode_time`)

KV transfer (prefill → kvstore → decode) is base + per_byte·bytes, per path (shm | network).
"""

from __future__ import annotations

import functools
import json
import logging
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PROFILE_VERSION = 1


@dataclass(frozen=True)
class PrefillFit:
    base_s: float
    per_token_s: float
    per_attn_pair_s: float
    per_seq_s: float

    def __post_init__(self) -> None:
        _non_negative(self, "prefill fit")


@dataclass(frozen=True)
class DecodeFit:
    base_s: float
    per_seq_s: float
    per_ctx_token_s: float

    def __post_init__(self) -> None:
        _non_negative(self, "decode fit")


@dataclass(frozen=True)
class LinearFit:
    base_s: float
    per_byte_s: float

    def __post_init__(self) -> None:
        _non_negative(self, "transfer fit")

    def __call__(self, nbytes: float) -> float:
        return self.base_s + self.per_byte_s * nbytes


@dataclass(frozen=True)
class TransferFit:
    write: LinearFit  # prefill: allocate + write + commit
    read: LinearFit  # decode: lookup + read + release


@dataclass(frozen=True)
class EngineLimits:
    """The serving knobs the profile's machine runs with (the simulator's defaults)."""

    block_size: int = 16
    max_num_batched_tokens: int = 512  # the chunked-prefill budget per step
    max_num_seqs: int = 64
    num_kv_blocks: int = 2048  # per decode / colocated worker
    prefill_max_inflight: int = 4  # jobs one prefill worker holds at once
    kv_bytes_per_block: int = 368_640
    kvstore_slots: int = 1024  # the prefix cache's capacity in blocks (one store per host)
    gpus_per_worker: int = 1  # accelerators one worker occupies (tensor parallel); goodput per GPU divides by it

    def __post_init__(self) -> None:
        for name, value in self.__dict__.items():
            if value <= 0:
                raise ValueError(f"profile engine limits: {name} must be positive, got {value}")


@dataclass(frozen=True)
class Profile:
    prefill: PrefillFit
    decode: DecodeFit
    transfer: dict[str, TransferFit]  # "shm" | "network"
    limits: EngineLimits = EngineLimits()
    # fixed per-request time outside the engine (gateway, queues, publish hops), split by phase
    request_overhead_s: float = 0.0
    # time from a prefill's first token to its decode job's KV read beginning, beyond the KV write:
    # the job's hops and pickup, and per block of KV moved, what the kvstore paths above leave out
    # (the engines' export and import; on a fresh CPU stack, before the KV memory was faulted in
    # ahead of use, mostly the first touch of the decode worker's cache pages). A calibration
    # measures both in the first decode gap, of a short prompt and of a long one
    handoff_s: float = 0.0
    handoff_per_block_s: float = 0.0
    # tokens a stream receives per event (speculative decoding: a step verifies several and keeps
    # the accepted ones); the decode fit is then per token, and an event's gap spans this many
    tokens_per_event: float = 1.0
    # the spread of a stream's event gaps around their mean, as measured by a calibration: quantiles
    # of gap ÷ mean (mean 1). A simulated gap g stands for g·q for each q, equally weighted: draft
    # lengths that vary step to step and threads descheduled on shared cores, which the step fits
    # (means) do not carry. (1.0,): no spread.
    itl_shape: tuple[float, ...] = (1.0,)
    # what one more token per event adds to a decode step, per sequence: a speculative step
    # verifies each sequence's drafts, the ones it keeps and some it rejects, so the more a
    # workload's drafts are accepted, the longer its events and the shorter its time per token
    # (`with_tokens_per_event`). Per sequence: at 4 streams of 188-token answers (τ 2.93) the event
    # gap was 43.6 ms against 27 ms for 40-token ones (τ 1.4–1.7), ~3 ms per sequence per extra
    # token, as at batch 1
    spec_token_s: float = 0.0
    # the draft tokens a sequence's step verified, per event, where the calibration measured them
    # (pdserve's usage.draft_tokens); None: τ − 1 stands in (kept drafts only, a lower bound).
    # `spec_token_s` is per such draft row when they were measured
    drafts_per_event: float | None = None
    # the engine's own measure of what one more row costs a step (its table of step time by rows):
    # what a calibration falls back on when its requests' acceptance is too alike to read a slope
    draft_row_s: float = 0.0
    # engines on one host lend each other their cores while idle (`pdserve up`: shared/engine/cores.py),
    # and the fits above are of the lent case, as a calibration sees it: (prefill, decode) is what a
    # step takes instead, ×, when it cannot borrow — a prefill step while a decode worker holds
    # sequences, a decode step of ≥ 2 sequences (a batch of 1 never borrows) while a prefill step
    # runs; a prefill step that began on borrowed cores goes on at the prefill factor while a decode
    # worker holds sequences (its second thread shares a core with the decode worker's, and yields
    # to it). (1, 1): pools that share nothing (a GPU each)
    unlent: tuple[float, float] = (1.0, 1.0)
    # a CPU engine's decode step on the whole host, where the fits above are of its step on its own
    # share of the cores (half of them; a calibration reads both off the served engine's step log):
    # served, more threads halve a row's work but cost a fixed part more a step (on 2 cores the
    # serving processes beside the team stall its barriers, ~5 ms), so a batch of one costs about
    # the same on both cores and a batch of eight much less (shared/sim/cores.py). Same form as
    # `decode` and `spec_token_s`; None: one fit for any width
    decode_wide: DecodeFit | None = None
    spec_token_wide_s: float = 0.0
    # what one more draft adds to a step per token of its sequence's context (both widths): a draft
    # row attends over the context as the sequence's own row does, so a long document's drafts cost
    # more than a chat's. Read off a calibration's logged steps (one context term per row); 0: the
    # context term is per sequence, whatever its drafts
    spec_ctx_token_s: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.transfer:
            raise ValueError("profile: no KV transfer path")
        if self.request_overhead_s < 0 or self.handoff_s < 0 or self.handoff_per_block_s < 0:
            raise ValueError("profile: request_overhead_s, handoff_s and handoff_per_block_s must be >= 0")
        if not self.tokens_per_event >= 1:
            raise ValueError(f"profile: tokens_per_event must be >= 1, got {self.tokens_per_event}")
        if not self.itl_shape or min(self.itl_shape) <= 0:
            raise ValueError(f"profile: itl_shape must be positive factors, got {self.itl_shape}")
        if (self.drafts_per_event is not None and not self.drafts_per_event >= 0) or not self.draft_row_s >= 0:
            raise ValueError("profile: drafts_per_event and draft_row_s must be >= 0")
        if not self.spec_token_wide_s >= 0 or not self.spec_ctx_token_s >= 0:
            raise ValueError("profile: spec_token_wide_s and spec_ctx_token_s must be >= 0")
        if len(self.unlent) != 2 or not min(self.unlent) >= 1:
            raise ValueError(f"profile: unlent must be two factors >= 1, got {self.unlent}")

    def with_tokens_per_event(self, tau: float, drafts: float | None = None) -> Profile:
        """This profile for a workload whose streams get `tau` tokens an event (its drafts accepted
        more or less often than the calibration's), verifying `drafts` draft tokens a sequence's
        step (None: as many more or fewer than the calibration's as tokens kept): a step grows by
        `spec_token_s` per sequence and `spec_ctx_token_s` per context token for each extra draft,
        and the decode fit (per token) is that step ÷ τ."""
        if not tau >= 1:
            raise ValueError(f"tokens per event must be >= 1, got {tau}")
        t0, d = self.tokens_per_event, self.decode
        d0 = t0 - 1 if self.drafts_per_event is None else self.drafts_per_event
        d1 = d0 + (tau - t0) if drafts is None else drafts
        if d1 < 0:
            raise ValueError(f"drafts per event must be >= 0, got {d1}")

        def moved(d: DecodeFit, spec: float) -> DecodeFit:
            per_seq = (d.per_seq_s * t0 + spec * (d1 - d0)) / tau
            if per_seq < 0:
                raise ValueError(f"tokens per event {tau}: below what this profile's calibration can extrapolate to")
            per_ctx = (d.per_ctx_token_s * t0 + self.spec_ctx_token_s * (d1 - d0)) / tau
            return DecodeFit(d.base_s * t0 / tau, per_seq, per_ctx)

        known = None if drafts is None and self.drafts_per_event is None else d1
        wide = None if self.decode_wide is None else moved(self.decode_wide, self.spec_token_wide_s)
        return replace(self, decode=moved(d, self.spec_token_s), decode_wide=wide, tokens_per_event=tau,
                       drafts_per_event=known)

    # ----------------------------------------------------------------------------- step times

    def prefill_time(self, tokens: int, attn_pairs: float, seqs: int) -> float:
        p = self.prefill
        return p.base_s + p.per_token_s * tokens + p.per_attn_pair_s * attn_pairs + p.per_seq_s * seqs

    def decode_time(self, batch: int, ctx_tokens: int, wide: bool = False) -> float:
        """A decode step of `batch` sequences holding `ctx_tokens` between them, per token (÷ τ);
        `wide`: on the whole host (`decode_wide`, where the profile has it)."""
        d = self.decode_wide if wide and self.decode_wide is not None else self.decode
        return d.base_s + d.per_seq_s * batch + d.per_ctx_token_s * ctx_tokens

    def wide_decode_ratio(self, batch: int, ctx_tokens: int) -> float:
        """A decode step on the whole host ÷ one on the engine's share (1 without `decode_wide`)."""
        if self.decode_wide is None or batch < 1:
            return 1.0
        return self.decode_time(batch, ctx_tokens, wide=True) / self.decode_time(batch, ctx_tokens)

    def riding_decode_time(self, batch: int, ctx_tokens: int, drafts: float = 0.0) -> float:
        """What `batch` decoding sequences add to a step that computes a prompt's chunk: their rows
        (1 + `drafts` each) at the prefill rates, and each one's KV read as a decode step reads it."""
        p = self.prefill
        return batch * ((1 + drafts) * p.per_token_s + p.per_seq_s) + \
            self.decode.per_ctx_token_s * self.tokens_per_event * ctx_tokens

    def drafts(self) -> float:
        """Draft tokens a sequence's speculative step verifies (τ − 1 where none were measured)."""
        return self.tokens_per_event - 1 if self.drafts_per_event is None else self.drafts_per_event

    def host_cores(self) -> int | None:
        """The cores of the host a CPU profile was measured on (`pdserve profile` records them); None
        for a GPU profile, or where the profile does not say."""
        if self.meta.get("device") != "cpu":
            return None
        m = re.search(r"(\d+) cores", str(self.meta.get("machine", "")))
        return int(m[1]) if m else None

    def handoff_time(self, blocks: int) -> float:
        return self.handoff_s + self.handoff_per_block_s * blocks

    def transfer_time(self, path: str, nbytes: int) -> tuple[float, float]:
        """(write, read) seconds for one request's KV of `nbytes` over `path`."""
        fit = self.transfer.get(path) or next(iter(self.transfer.values()))
        return fit.write(nbytes), fit.read(nbytes)

    # -------------------------------------------------------------------------------- file I/O

    def to_json(self) -> dict[str, Any]:
        """A new dict (copies: editing it leaves this profile as it was)."""
        return {"version": PROFILE_VERSION, "meta": dict(self.meta), "limits": asdict(self.limits),
                "request_overhead_s": self.request_overhead_s, "handoff_s": self.handoff_s,
                "handoff_per_block_s": self.handoff_per_block_s,
                "tokens_per_event": self.tokens_per_event,
                "itl_shape": list(self.itl_shape), "spec_token_s": self.spec_token_s, "unlent": list(self.unlent),
                "drafts_per_event": self.drafts_per_event, "draft_row_s": self.draft_row_s,
                "prefill": {"fit": asdict(self.prefill)}, "decode": {"fit": asdict(self.decode)},
                **({} if self.decode_wide is None else {"decode_wide": {"fit": asdict(self.decode_wide)},
                                                          "spec_token_wide_s": self.spec_token_wide_s}),
                **({"spec_ctx_token_s": self.spec_ctx_token_s} if self.spec_ctx_token_s else {}),
                "kv_transfer": {path: {"write": asdict(t.write), "read": asdict(t.read)}
                                for path, t in self.transfer.items()}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Profile:
        if data.get("version") != PROFILE_VERSION:
            raise ValueError(f"profile version {data.get('version')!r}, expected {PROFILE_VERSION}")
        try:
            transfer = {path: TransferFit(LinearFit(**t["write"]), LinearFit(**t["read"]))
                        for path, t in data["kv_transfer"].items()}
            return cls(prefill=PrefillFit(**data["prefill"]["fit"]), decode=DecodeFit(**data["decode"]["fit"]),
                       transfer=transfer, limits=EngineLimits(**data.get("limits", {})),
                       request_overhead_s=float(data.get("request_overhead_s", 0.0)),
                       handoff_s=float(data.get("handoff_s", 0.0)),
                       handoff_per_block_s=float(data.get("handoff_per_block_s", 0.0)),
                       tokens_per_event=float(data.get("tokens_per_event", 1.0)),
                       itl_shape=tuple(float(q) for q in data.get("itl_shape", (1.0,))),
                       spec_token_s=float(data.get("spec_token_s", 0.0)),
                       drafts_per_event=None if data.get("drafts_per_event") is None
                       else float(data["drafts_per_event"]),
                       draft_row_s=float(data.get("draft_row_s", 0.0)),
                       unlent=tuple(float(f) for f in data.get("unlent", (1.0, 1.0))),
                       decode_wide=DecodeFit(**data["decode_wide"]["fit"]) if data.get("decode_wide") else None,
                       spec_token_wide_s=float(data.get("spec_token_wide_s", 0.0)),
                       spec_ctx_token_s=float(data.get("spec_ctx_token_s", 0.0)), meta=data.get("meta", {}))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"profile: malformed ({exc})") from None

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        return cls.from_json(json.loads(Path(path).read_text()))


# The reference CPU profile (an AVX-512 VNNI Zen 4): the host the accuracy cases were sized on
# (services/planner/calibrate.py). Profiles of other kinds of CPU lie beside it, named by the ISA
# of the kernels they ran (`cpu_isa()`): cpu-smollm2-135m-amx.json.
DEFAULT_PROFILE = Path(__file__).with_name("profiles") / "cpu-smollm2-135m.json"


def shipped_profile() -> Path:
    """The shipped profile measured on this kind of CPU, else the reference one."""
    from shared.kernels.cpu_ext import cpu_isa

    own = DEFAULT_PROFILE.with_name(f"{DEFAULT_PROFILE.stem}-{cpu_isa()}.json")
    return own if own.exists() else DEFAULT_PROFILE


def load_profile(path: str | Path | None) -> Profile:
    """The given profile file, or the one shipped for this machine kind (measured by `pdserve
    profile`); a CPU profile measured on another kind of CPU than this one is said so, once."""
    p = Path(path) if path else shipped_profile()
    if not p.exists():
        raise FileNotFoundError(f"profile {p} not found (write one with `pdserve profile --out {p}`)")
    profile = Profile.load(p)
    _warn_other_cpu(str(p), profile.meta.get("device", ""), profile.meta.get("isa", ""))
    return profile


@functools.cache
def _warn_other_cpu(path: str, device: str, isa: str) -> None:
    from shared.kernels.cpu_ext import cpu_isa

    if device == "cpu" and isa and isa != (here := cpu_isa()):
        log.warning("profile %s was measured on an %s CPU, this one runs %s kernels: its step times may be far "
                    "off here (measure this machine with `pdserve profile --out FILE`, then pass --profile FILE)",
                    path, isa, here)


def _non_negative(obj: object, what: str) -> None:
    for name, value in obj.__dict__.items():
        if not value >= 0:
            raise ValueError(f"{what}: {name} must be >= 0, got {value}")
