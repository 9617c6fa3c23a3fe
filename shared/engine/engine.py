"""The engine every pool runs: schedule → run → postprocess, one step at a time.

Roles (DESIGN.md): *colocated* runs a request from prompt to finish; *prefill-only*
(`add_request(..., prefill_only=True)`) stops after the first token and keeps the blocks so the
caller can `export_kv` them; *decode-only* (`add_prefilled`) starts from a first token and KV
blocks computed elsewhere. All three are the same step loop.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from shared.config import EngineConfig
from shared.engine.model_runner import ModelRunner, ScheduledChunk
from shared.engine.scheduler import Scheduler
from shared.engine.sequence import FinishReason, Sequence, SequenceStatus
from shared.engine.stop import StopChecker
from shared.kvcache.block_pool import BlockPool
from shared.kvcache.kv_cache import KVCache
from shared.kvcache.kv_cache_manager import KVCacheManager
from shared.model.detokenizer import IncrementalDetokenizer
from shared.model.hub import resolve_model_path
from shared.model.llama import LlamaModel, load_model
from shared.model.sampling import SamplingParams, sample
from shared.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class RequestError(ValueError):
    """A request the engine cannot take (too long, empty, duplicate id)."""


@dataclass
class EngineStats:
    """Counters since start (the services export them as metrics)."""

    steps: int = 0
    tokens_computed: int = 0  # tokens run through the model (prefill chunks + decode tokens)
    preemptions: int = 0


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    text: str  # new text since the previous output of this request
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    stop_reason: str | int | None = None


class LLMEngine:
    def __init__(self, model: LlamaModel, tokenizer: Tokenizer | None, config: EngineConfig, model_id: str = ""):
        self.model, self.tokenizer, self.config = model, tokenizer, config
        mcfg = model.config
        self.max_model_len = min(config.max_model_len or mcfg.max_model_len, mcfg.max_model_len)
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < self.max_model_len:
            # without chunking a whole prompt must fit one step
            config.max_num_batched_tokens = self.max_model_len
        self.kv_cache = KVCache(mcfg, config.num_kv_blocks, config.block_size,
                                dtype=next(model.parameters()).dtype, device=config.device)
        self.pool = BlockPool(config.num_kv_blocks, config.enable_prefix_caching)
        self.kv = KVCacheManager(self.pool, config.block_size, model_id or mcfg.name)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.enable_chunked_prefill)
        self.runner = ModelRunner(model, self.kv_cache)
        eos = tokenizer.stop_token_ids if tokenizer is not None else set()
        self.stop_checker = StopChecker(set(eos), self.max_model_len)
        self.seqs: dict[str, Sequence] = {}
        self.stats = EngineStats()
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._sent: dict[str, int] = {}  # characters of text already returned

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        path = resolve_model_path(config.model)
        model = load_model(path, dtype=config.torch_dtype, device=config.device, quantization=config.quantization)
        tokenizer = Tokenizer.from_gguf(path) if Path(path).is_file() else Tokenizer.from_hf_dir(path)
        return cls(model, tokenizer, config, model_id=Path(path).name)

    # --------------------------------------------------------------------------------- requests

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams, *,
                    prefill_only: bool = False, prefix_kv: torch.Tensor | None = None,
                    num_resumed: int = 0) -> Sequence:
        """Queue a request. `prefix_kv`: KV of the prompt's first whole blocks, computed elsewhere
        (the kvstore's prefix cache); only the rest of the prompt is computed here.
        `num_resumed`: output tokens streamed before (a migrated request), for seeded sampling."""
        seq = self._new_sequence(request_id, prompt_ids, params)
        seq.prefill_only, seq.num_resumed = prefill_only, num_resumed
        if prefix_kv is not None and prefix_kv.shape[0] > 0:
            n_tokens = prefix_kv.shape[0] * self.config.block_size
            if n_tokens >= len(prompt_ids):
                self.seqs.pop(request_id)
                raise RequestError(f"request {request_id}: the supplied prefix covers the whole prompt")
            self._import_kv(seq, prefix_kv, n_tokens)
            seq.num_cached_tokens = n_tokens
        self.scheduler.add(seq)
        return seq

    def add_prefilled(self, request_id: str, prompt_ids: list[int], first_token: int, kv_blocks: torch.Tensor,
                      params: SamplingParams, *, num_resumed: int = 0, num_cached_tokens: int = 0) -> Sequence:
        """Decode-only entry: the prompt's KV (whole blocks, the last maybe partial) and the first
        token come from a prefill worker. Raises MemoryError when the blocks don't fit now."""
        seq = self._new_sequence(request_id, prompt_ids, params)
        seq.num_resumed, seq.num_cached_tokens = num_resumed, num_cached_tokens
        if kv_blocks.shape[0] != -(-len(prompt_ids) // self.config.block_size):
            self.seqs.pop(request_id)
            raise RequestError(f"request {request_id}: {kv_blocks.shape[0]} KV blocks for a {len(prompt_ids)}-token prompt")
        self._import_kv(seq, kv_blocks, len(prompt_ids))
        self._append_token(seq, first_token)
        if not seq.is_finished:
            self.scheduler.add(seq)
        return seq

    def _import_kv(self, seq: Sequence, blocks: torch.Tensor, num_tokens: int) -> None:
        """Give `seq` blocks holding the KV of its first `num_tokens` tokens, copied from `blocks`."""
        if not self.kv.allocate_slots(seq, num_tokens):
            self.seqs.pop(seq.request_id)
            self._forget(seq.request_id)
            raise MemoryError(f"no room for {blocks.shape[0]} KV blocks")
        self.kv_cache.write_blocks(seq.block_table, blocks)
        seq.num_computed_tokens = num_tokens
        self.kv.cache_full_blocks(seq)

    def _new_sequence(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        if request_id in self.seqs:
            raise RequestError(f"request id {request_id!r} is already in use")
        if not prompt_ids:
            raise RequestError(f"request {request_id}: the prompt is empty")
        vocab = self.model.config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise RequestError(f"request {request_id}: prompt token ids must be in [0, {vocab})")
        if len(prompt_ids) >= self.max_model_len:
            raise RequestError(
                f"request {request_id}: the prompt has {len(prompt_ids)} tokens; the model's context "
                f"length is {self.max_model_len}, and at least one token must be generated"
            )
        max_blocks = -(-min(len(prompt_ids) + params.max_tokens, self.max_model_len) // self.config.block_size)
        if max_blocks > self.config.num_kv_blocks:
            raise RequestError(
                f"request {request_id}: prompt + max_tokens needs {max_blocks} KV blocks, the cache has "
                f"{self.config.num_kv_blocks}"
            )
        seq = Sequence(request_id, list(prompt_ids), params)
        self.seqs[request_id] = seq
        self._sent[request_id] = 0
        if self.tokenizer is not None:
            self._detok[request_id] = IncrementalDetokenizer(
                self.tokenizer, prompt_ids, skip_special_tokens=params.skip_special_tokens
            )
        return seq

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is; every block it holds is freed. False if unknown."""
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return False
        if not seq.is_finished:
            self.scheduler.finish(seq, FinishReason.ABORT)
        elif seq.block_table:  # a prefill-only sequence whose blocks were never exported
            self.kv.free(seq)
        self._forget(request_id)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ------------------------------------------------------------------------------------ step

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        self.stats.preemptions += len(sched.preempted)
        if not sched.scheduled:
            return []
        self.stats.steps += 1
        self.stats.tokens_computed += sched.num_batched_tokens
        logits = self.runner.execute([self._chunk(s.seq, s.num_new_tokens, s.completes_prompt) for s in sched.scheduled])
        sampled = [s.seq for s in sched.scheduled if s.completes_prompt]
        tokens = self._sample(logits, sampled)
        for s in sched.scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens
            self.kv.cache_full_blocks(s.seq)
        return self._postprocess(sampled, tokens)

    def _chunk(self, seq: Sequence, n: int, need_logits: bool) -> ScheduledChunk:
        start = seq.num_computed_tokens
        if n == 1 and start == seq.num_tokens - 1:
            ids = [seq.output_ids[-1] if seq.output_ids else seq.prompt_ids[-1]]
        else:
            ids = seq.all_token_ids[start:start + n]
        return ScheduledChunk(ids, start, seq.block_table, need_logits)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        for row, seq in enumerate(seqs):  # min_tokens: the model may not end the sequence yet
            p = seq.params
            if len(seq.output_ids) < p.min_tokens:
                banned = list(set(p.stop_token_ids) | (set() if p.ignore_eos else self.stop_checker.eos_token_ids))
                if banned:
                    logits[row, banned] = float("-inf")
        return sample(logits, [s.params for s in seqs], [s.num_resumed + len(s.output_ids) for s in seqs])

    def _postprocess(self, seqs: list[Sequence], tokens: list[int]) -> list[RequestOutput]:
        outputs = []
        for seq, token in zip(seqs, tokens):
            self._append_token(seq, token)
            outputs.append(self.make_output(seq, [token]))
        return outputs

    def _append_token(self, seq: Sequence, token: int) -> None:
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        seq.output_ids.append(token)
        detok = self._detok.get(seq.request_id)
        delta = detok.push(token) if detok is not None else ""
        seq.text += delta
        reason = self.stop_checker.check(seq, len(delta))
        if reason is None and seq.prefill_only:
            reason = FinishReason.PREFILLED
        if reason is not None:
            self._finish(seq, reason)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.status == SequenceStatus.WAITING and seq not in self.scheduler.waiting:
            seq.status = SequenceStatus.FINISHED  # decode-only entry finishing on its first token
            seq.finish_reason = reason
            if reason != FinishReason.PREFILLED:
                self.kv.free(seq)
            return
        self.scheduler.finish(seq, reason, keep_blocks=reason == FinishReason.PREFILLED)

    def make_output(self, seq: Sequence, new_tokens: list[int]) -> RequestOutput:
        rid = seq.request_id
        if seq.is_finished and rid in self._detok and not isinstance(seq.stop_reason, str):
            seq.text += self._detok[rid].flush()
        end = StopChecker.streamable_len(seq)
        text = seq.text[self._sent[rid]:end]
        self._sent[rid] = max(self._sent[rid], end)
        out = RequestOutput(
            request_id=rid, new_token_ids=new_tokens, text=text, finished=seq.is_finished,
            finish_reason=seq.finish_reason, num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens, num_output_tokens=len(seq.output_ids),
            stop_reason=seq.stop_reason,
        )
        if seq.is_finished and seq.finish_reason != FinishReason.PREFILLED:
            self.seqs.pop(rid, None)
            self._forget(rid)
        return out

    def _forget(self, request_id: str) -> None:
        self._detok.pop(request_id, None)
        self._sent.pop(request_id, None)

    # ------------------------------------------------------------------------- KV export (P → D)

    def export_kv(self, request_id: str) -> tuple[Sequence, torch.Tensor]:
        """A prefilled sequence's prompt KV as whole blocks [n, L, 2, bs, Hkv, Dh]; then frees it."""
        seq = self.seqs.pop(request_id)
        if seq.finish_reason != FinishReason.PREFILLED:
            raise RequestError(f"request {request_id} is not a finished prefill-only request")
        n = -(-seq.num_prompt_tokens // self.config.block_size)
        blocks = self.kv_cache.read_blocks(seq.block_table[:n])
        self.kv.free(seq)
        self._forget(request_id)
        return seq, blocks

    # ------------------------------------------------------------------------------ convenience

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[RequestOutput]:
        """Run prompts to completion (batched); one final output per prompt, in order, with the
        whole text and all token ids."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{id(prompts)}-{i}" for i in range(len(prompts))]
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        texts: dict[str, list[str]] = {rid: [] for rid in ids}
        final: dict[str, RequestOutput] = {}
        for rid, prompt, p in zip(ids, prompts, params_list):
            self.add_request(rid, prompt, p)
        while self.has_unfinished():
            for out in self.step():
                tokens[out.request_id].extend(out.new_token_ids)
                texts[out.request_id].append(out.text)
                if out.finished:
                    final[out.request_id] = out
        results = []
        for rid in ids:
            out = final[rid]
            out.new_token_ids, out.text = tokens[rid], "".join(texts[rid])
            results.append(out)
        return results
