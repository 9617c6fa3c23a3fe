"""Continuous batching with chunked prefill under a per-step token budget.

Each step:
  1. running sequences first, oldest first: a decode needs 1 token, an unfinished prefill the
     rest of its prompt (cut to the budget when chunking is on). When blocks run out, the newest
     running sequence is preempted (blocks freed, recomputed later; the prefix cache usually makes
     that cheap) until the older one fits.
  2. then waiting sequences, first come first served, while slots, budget and blocks allow; each
     first takes its longest cached prefix and computes only the rest.
Policy (the order above) lives here; block mechanics live in KVCacheManager.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from shared.engine.sequence import FinishReason, Sequence, SequenceStatus
from shared.kvcache.kv_cache_manager import KVCacheManager


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int

    @property
    def completes_prompt(self) -> bool:
        """After this chunk every token has KV, so the next token gets sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_new_tokens, budget)
            if self._make_room(seq, n, out):
                out.scheduled.append(ScheduledSeq(seq, n))
                budget -= n
                i += 1
            elif seq.status == SequenceStatus.WAITING:  # it preempted itself: nothing older is left
                break
        if out.preempted:
            return out  # memory is tight: admit nobody new this step
        budget = self._admit_holding_kv(out, budget)
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            if not seq.block_table and seq.params.prompt_logprobs is None:  # those need every prompt row
                cached = self.kv.match_prefix(seq)
                if seq.num_preemptions == 0:
                    seq.num_cached_tokens = cached
            n = seq.num_new_tokens
            if n > budget:
                if not self.enable_chunked_prefill:
                    break  # a whole prompt per step: wait for a step with room
                n = budget
            if not self.kv.allocate_slots(seq, n):
                self.kv.free(seq)  # don't sit on prefix blocks while waiting
                seq.num_computed_tokens = 0
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        return out

    def _admit_holding_kv(self, out: SchedulerOutput, budget: int) -> int:
        """Waiting sequences that already hold their KV (a decode job's imported blocks) go first:
        each needs a token a step, and frees its blocks as it ends. Behind a sequence that must compute
        its prompt (a preempted one, recomputed) they could wait for ever: while they hold their
        blocks that prompt may never fit, so neither ran. Returns the budget left."""
        for seq in [s for s in self.waiting if s.block_table and s.num_new_tokens == 1]:
            if len(self.running) >= self.max_num_seqs or budget <= 0 or not self.kv.allocate_slots(seq, 1):
                break
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, 1))
            budget -= 1
        return budget

    def _make_room(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Allocate blocks for `n` more tokens of `seq`, preempting the newest running sequences."""
        while not self.kv.allocate_slots(seq, n):
            victim = self.running[-1]
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: FinishReason, keep_blocks: bool = False) -> None:
        """Retire a sequence; its blocks are freed unless the caller takes them (prefill-only)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if not keep_blocks:
            self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def find(self, request_id: str) -> Sequence | None:
        for seq in self.running:
            if seq.request_id == request_id:
                return seq
        for seq in self.waiting:
            if seq.request_id == request_id:
                return seq
        return None
