"""Scenario presets for `pdserve up --preset NAME`: each a documented bundle of the settings that
matter for one kind of traffic (mode, pool sizes, chunked-prefill budget, prefix cache,
speculation, batch limit, routing, conditional thresholds).

    setting                  chat          long-doc      batch         platform
    --mode                   conditional   conditional   colocated     disaggregated
    --prefill / --decode     1 / 1         1 / 1         - / 1         1 / 1
    --max-num-batched-tokens 256           512           2048          512
    prefix cache             on            on            off           on
    chunked prefill          on            on            on            on
    --speculative            suffix        ngram         off           suffix
    --max-num-seqs           64            16            128           64
    --router                 cache-aware   cache-aware   least-loaded  cache-aware
    --conditional-threshold  512           256           -             -
    --conditional-busy-thr.  1024          1024          -             -
    --conditional-queue-tok. 2048          8192          -             -

The pool sizes fit a 2-core machine; on a bigger one scale them with --prefill/--decode (a flag
always wins over the preset). `pdserve up --preset NAME --dry-run` shows what a preset resolves
to and the command line of every process it would start.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from services.gateway.config import MODES, ROUTERS
from shared.config import SPEC_MODES


@dataclass(frozen=True)
class Preset:
    """One scenario. Each field is the value of the `pdserve up` option of the same name; None
    leaves that option at its default (e.g. conditional thresholds in a mode that has none)."""

    name: str
    summary: str  # the traffic it is for, in a few words
    why: str  # the reasoning, from the serving literature
    mode: str
    prefill: int  # prefill workers (unused in colocated mode)
    decode: int  # decode workers (colocated mode: engine workers)
    max_num_batched_tokens: int  # tokens per forward pass: the chunked-prefill budget
    prefix_caching: bool
    chunked_prefill: bool
    speculative: str
    max_num_seqs: int  # running sequences per engine step
    router: str
    hot_spot_factor: float | None = None
    conditional_threshold: int | None = None
    conditional_busy_threshold: int | None = None
    conditional_queue_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"preset {self.name}: mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.router not in ROUTERS:
            raise ValueError(f"preset {self.name}: router must be one of {', '.join(ROUTERS)}, got {self.router!r}")
        if self.speculative not in SPEC_MODES:
            raise ValueError(f"preset {self.name}: speculative must be one of {', '.join(SPEC_MODES)}")
        for name in ("prefill", "decode", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) <= 0:
                raise ValueError(f"preset {self.name}: {name} must be positive, got {getattr(self, name)}")

    def settings(self) -> dict[str, object]:
        """The options this preset fixes, by `pdserve up` option name (argparse dest)."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in ("name", "summary", "why") and getattr(self, f.name) is not None}


CHAT = Preset(
    name="chat",
    summary="short prompts, many turns, tokens read as they stream",
    why="Short prompts, many turns: each turn resends the whole conversation, so the prefix cache turns "
        "it into a few new tokens (SGLang's RadixAttention; vLLM automatic prefix caching) and the "
        "cache-aware router sends a conversation back to the worker that holds it (Preble, SGLang "
        "router). Conditional mode prefills those short uncached remainders where they decode, skipping "
        "the KV transfer, and sends only long first turns to the prefill pool. Users read tokens as they "
        "stream, so inter-token latency rules: a small chunk budget (256) bounds how much prefill a "
        "decode step shares its batch with (Sarathi-Serve's stall-free batching), continuous batching "
        "keeps up to 64 conversations in flight, and suffix speculation reuses the conversation's own "
        "text and earlier answers (SuffixDecoding).",
    mode="conditional", prefill=1, decode=1, max_num_batched_tokens=256, prefix_caching=True,
    chunked_prefill=True, speculative="suffix", max_num_seqs=64, router="cache-aware",
    conditional_threshold=512, conditional_busy_threshold=1024, conditional_queue_tokens=2048,
)

LONG_DOC = Preset(
    name="long-doc",
    summary="long documents, short questions about them",
    why="Long documents, short questions about them: prefill dominates, and one long prompt prefilled "
        "beside running decodes stalls them (DistServe, Splitwise), so a new document goes to the "
        "prefill pool and is prefilled in 512-token chunks (Sarathi-Serve) that keep each step short. "
        "Follow-up questions about a cached document have only the question uncached: the prefix cache "
        "and cache-aware router reuse the document's blocks, and conditional mode (threshold 256) "
        "answers them on the decode worker without moving KV. Answers quote the document, so n-gram "
        "speculation over the prompt (prompt lookup decoding) accepts long drafts. Few sequences (16) "
        "fit at once: each holds thousands of tokens of KV.",
    mode="conditional", prefill=1, decode=1, max_num_batched_tokens=512, prefix_caching=True,
    chunked_prefill=True, speculative="ngram", max_num_seqs=16, router="cache-aware",
    conditional_threshold=256, conditional_busy_threshold=1024, conditional_queue_tokens=8192,
)

BATCH = Preset(
    name="batch",
    summary="offline throughput, independent prompts",
    why="Offline throughput (evaluations, bulk generation): no one watches the latency of one "
        "request, so one colocated engine runs the largest batches it can (128 sequences, a 2048-token "
        "chunk budget: big GEMMs, weights read once per step for many tokens, as in Orca's and vLLM's "
        "throughput settings) with nothing moved between pools. Speculation is off: at large batch the "
        "engine is compute-bound and rejected drafts are wasted work (speculation pays at low batch "
        "size). The prefix cache is off: batch prompts are independent, so there is little to reuse and "
        "every KV block goes to running sequences instead of holding cached prefixes. Least-loaded routing "
        "balances the engines when --decode adds more.",
    mode="colocated", prefill=1, decode=1, max_num_batched_tokens=2048, prefix_caching=False,
    chunked_prefill=True, speculative="off", max_num_seqs=128, router="least-loaded",
)

PLATFORM = Preset(
    name="platform",
    summary="a shared service for mixed traffic: everything on",
    why="A shared service for unknown, mixed traffic: everything on. Disaggregated prefill and decode "
        "pools isolate decode latency from prefill bursts and scale independently (DistServe, Mooncake), "
        "the prefix cache and the cache-aware router reuse shared system prompts and conversations "
        "(with the hot-spot guard against piling onto one worker), chunked prefill at 512 tokens, "
        "suffix speculation and continuous batching up to 64 sequences.",
    mode="disaggregated", prefill=1, decode=1, max_num_batched_tokens=512, prefix_caching=True,
    chunked_prefill=True, speculative="suffix", max_num_seqs=64, router="cache-aware",
)

PRESETS: dict[str, Preset] = {p.name: p for p in (CHAT, LONG_DOC, BATCH, PLATFORM)}
