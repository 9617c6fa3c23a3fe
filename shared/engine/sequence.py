"""One request's state inside an engine: its tokens, its blocks, how far its KV is computed."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from shared.engine.speculative import SeqSpec
from shared.kvcache.block_hash import BlockKey
from shared.model.sampling_params import SamplingParams


class SequenceStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"  # cancelled by the caller
    PREFILLED = "prefilled"  # prefill-only role: first token sampled, blocks handed back


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    block_table: list[int] = field(default_factory=list)
    block_keys: list[BlockKey] = field(default_factory=list)  # keys of the full blocks computed so far
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = 0  # of the prompt, found in the prefix cache at admission
    expected_cached_tokens: int = 0  # … in it on arrival: the router's estimate until it is admitted
    num_preemptions: int = 0
    prefill_only: bool = False  # role: stop after the first token and keep the blocks for export
    num_resumed: int = 0  # output tokens produced before this engine got the request (migration)
    text: str = ""  # detokenized output so far (engines with a tokenizer fill it in)
    spec: SeqSpec = field(default_factory=SeqSpec)  # speculative decoding: acceptance, counts
    # params.prompt_logprobs: [p - 1] for prompt token p ≥ 1, filled in as the prompt's chunks run;
    # handed out with the first output, then None
    prompt_logprobs: list | None = None
    matcher: Any = None  # structured output: a shared.model.grammar.Matcher (None: free text)
    prefill_compute_s: float = 0.0  # step time charged to its prompt chunks (cost accounting)
    decode_compute_s: float = 0.0  # … to its decode rows
    prefill_core_s: float = 0.0  # the same, times the threads each step ran on
    decode_core_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError(f"request {self.request_id}: empty prompt")

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_new_tokens(self) -> int:
        """Tokens whose KV still has to be computed (1 for a decoding sequence)."""
        return self.num_tokens - self.num_computed_tokens
