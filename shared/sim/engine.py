"""One simulated worker: the policy of shared/engine/scheduler.py, timed by the profile.

A step, as in the real scheduler: running sequences first, oldest first (a decode needs 1 token, an
unfinished prefill the rest of its prompt cut to the token budget; when blocks run out the newest
running sequence is preempted and recomputed later), then waiting ones first come first served while
slots, budget and blocks allow. A sequence whose step completes its tokens samples one more.

Decode spans. When every running sequence is decoding and nothing can join, the batch stays the same
until the first of them finishes; its step times form an arithmetic series (the KV read grows by
B tokens a step), so K steps are one event:

    t_k = a + b·B + c·(C0 + k·B)        Σ_{k<K} t_k = K·(a + b·B + c·C0) + c·B·K(K−1)/2

A sequence that arrives mid-span cuts the span at the next step boundary (the real engine admits
it at the next schedule()). Nothing here allocates per token: a sequence is a handful of ints.
"""

from __future__ import annotations

import itertools
import math
from collections import deque

from shared.sim.cost import Profile


class SimSeq:
    __slots__ = ("rid", "kind", "num_tokens", "computed", "remaining", "blocks", "prefill_only", "cached",
                 "preemptions")

    def __init__(self, rid: int, kind: int, num_tokens: int, computed: int, remaining: int, prefill_only: bool,
                 cached: int = 0):
        self.rid, self.kind = rid, kind
        self.num_tokens = num_tokens  # tokens that exist (prompt + sampled so far)
        self.computed = computed  # tokens with KV in this worker
        self.remaining = remaining  # tokens still to sample here (prefill-only: 1)
        self.blocks = 0  # KV blocks held in this worker
        self.prefill_only = prefill_only
        self.cached = cached  # prompt tokens whose KV came from the prefix cache (not computed)
        self.preemptions = 0


class Span:
    """A decode span in flight: K steps of a fixed batch from `start`."""

    __slots__ = ("start", "steps", "batch", "ctx0", "first_step_s", "slow")

    def __init__(self, start: float, steps: int, batch: int, ctx0: int, first_step_s: float, slow: float = 1.0):
        self.start, self.steps, self.batch, self.ctx0, self.first_step_s = start, steps, batch, ctx0, first_step_s
        self.slow = slow  # every step × this (its cores shared: shared/sim/cores.py)


class SimEngine:
    """A worker's engine: blocks, the running batch, the waiting queue, and the step in flight."""

    def __init__(self, wid: int, role: str, profile: Profile, num_kv_blocks: int, max_num_seqs: int,
                 max_num_batched_tokens: int, spans: bool = True):
        self.wid, self.role, self.profile = wid, role, profile
        self.bs = profile.limits.block_size
        self.total_blocks, self.used_blocks = num_kv_blocks, 0
        self.max_num_seqs, self.budget = max_num_seqs, max_num_batched_tokens
        self.spans = spans
        self.running: list[SimSeq] = []
        self.waiting: deque[SimSeq] = deque()
        self.busy = False
        self.version = 0  # bumps when the step in flight is rescheduled (stale events are dropped)
        self.span: Span | None = None
        self.step_plan: list[tuple[SimSeq, int]] = []
        self.step_start = self.step_end = 0.0
        # the plain step in flight: its (prefill, decode) parts' fitted seconds and the factors they run
        # at (its cores: shared/sim/cores.py); when it computed a prompt's chunk too, the tokens per
        # event of its decode rows (None: a decode step, its tokens slices of events)
        self.step_parts = (0.0, 0.0)
        self.step_factors = (1.0, 1.0)
        self.step_tau: float | None = None
        self.spec_credit = 0.0  # tokens owed to speculative rows riding on chunks (`_kept`)
        self.threads = 0  # threads of the step in flight (on a shared CPU host)
        self.busy_s = 0.0  # time spent in steps (cost accounting)
        self.decode_rows = [0, 0]  # over its steps, Σ B and Σ B² of the sequences each decoded (B)
        self.preemptions = 0
        self.max_used_blocks = 0
        self.held = 0  # jobs held outside the engine: a prefill's KV being written, a decode job's being read
        self.intake_free_s = 0.0  # decode: KV reads run one at a time
        self.paused_until = 0.0  # decode: it handed a job back and pulls nothing until then
        self.unread: deque[int] = deque()  # decode: jobs waiting for blocks before their KV is read (in held)
        self.waiting_jobs: deque[SimSeq] = deque()  # decode: jobs read, waiting for blocks (in held)
        self.hungry = False  # waiting in its pool's queue of workers with room
        self.draining = False  # removed by a scaler: takes no new job, leaves when it holds none
        self.born_s = 0.0  # when its GPUs were taken (cost)
        self.retired_s: float | None = None  # when it left (None: still there)

    # ------------------------------------------------------------------------------- admission

    @property
    def num_requests(self) -> int:
        return len(self.running) + len(self.waiting)

    @property
    def free_blocks(self) -> int:
        return self.total_blocks - self.used_blocks

    def wide_ratio(self) -> float:
        """Its decode step on the whole host ÷ on its share, at the sequences it holds now
        (`Profile.wide_decode_ratio`; 1 where the profile does not fit a step's width)."""
        if self.profile.decode_wide is None:
            return 1.0
        seqs = [*self.running, *self.waiting]
        return self.profile.wide_decode_ratio(len(seqs), sum(s.num_tokens for s in seqs))

    def prefilling(self) -> bool:
        """A sequence here has a prompt (or a preempted one's tokens) to compute."""
        return any(s.num_tokens - s.computed > 1 for s in itertools.chain(self.running, self.waiting))

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.bs)

    def import_seq(self, seq: SimSeq) -> bool:
        """A decode job's KV arrives (add_prefilled): its blocks are taken now. False: no room."""
        need = self.blocks_for(seq.computed)
        if need > self.free_blocks:
            return False
        seq.blocks = need
        self._take(need)
        self.waiting.append(seq)
        return True

    def add(self, seq: SimSeq) -> None:
        """A whole request or a prefill job: blocks are taken when the scheduler admits it."""
        self.waiting.append(seq)

    def _take(self, n: int) -> None:
        self.used_blocks += n
        if self.used_blocks > self.total_blocks:
            raise AssertionError(f"worker {self.wid}: {self.used_blocks} KV blocks in use, budget {self.total_blocks}")
        if self.used_blocks > self.max_used_blocks:
            self.max_used_blocks = self.used_blocks

    def _free(self, seq: SimSeq) -> None:
        self.used_blocks -= seq.blocks
        seq.blocks = 0

    def _grow(self, seq: SimSeq, tokens: int) -> bool:
        need = self.blocks_for(tokens) - seq.blocks
        if need <= 0:
            return True
        if need > self.free_blocks:
            return False
        seq.blocks += need
        self._take(need)
        return True

    # -------------------------------------------------------------------------------- planning

    def plan(self, now: float, factors: tuple[float, float] = (1.0, 1.0)) -> float | None:
        """Choose the next step (or span) starting at `now`; returns its end time, None when idle.
        `factors`: its (prefill part, decode part) time × these (its cores: shared/sim/cores.py)."""
        if not self.running and not self.waiting:
            return None
        self.step_start = now
        span = self._try_span(now) if self.spans else None
        if span is not None:
            span.slow = factors[1]
            self.span, self.step_plan = span, []
            self.step_end = now + self._span_time(span, span.steps)
        else:
            self.span = None
            self.step_plan = self._schedule()
            if not self.step_plan:
                return None  # nothing fits (waiting on blocks that only a finish frees)
            self.step_parts = self._step_parts(self.step_plan)
            self.step_factors = factors
            self.step_end = now + self._step_duration()
        self.busy = True
        self.version += 1
        return self.step_end

    def _step_duration(self, factors: tuple[float, float] | None = None) -> float:
        (fp, fd), (p, d) = factors or self.step_factors, self.step_parts
        return fp * p + fd * d

    def _try_span(self, now: float) -> Span | None:
        running, waiting = self.running, self.waiting
        steps = 1 << 30
        ctx = 0
        for s in running:
            if s.num_tokens - s.computed != 1 or s.prefill_only:
                return None
            if s.remaining < steps:
                steps = s.remaining
            ctx += s.num_tokens
        # Waiting sequences that only need to decode (their KV imported) join now, first come first
        # served, as the scheduler would admit them this step; anything else waiting: plain steps.
        admitted = []
        while waiting and len(running) + len(admitted) < self.max_num_seqs:
            s = waiting[0]
            if s.num_tokens - s.computed != 1 or s.prefill_only or \
                    (s.computed + self.bs) // self.bs - s.blocks > self.free_blocks:
                break
            admitted.append(waiting.popleft())
            if s.remaining < steps:
                steps = s.remaining
            ctx += s.num_tokens
        if waiting and len(running) + len(admitted) < self.max_num_seqs or not running and not admitted:
            waiting.extendleft(reversed(admitted))
            return None
        running += admitted
        steps = min(steps, self._steps_within_blocks(steps))
        if steps < 2:  # a plain step (the admitted wait at the queue's head, in order, for it)
            del running[len(running) - len(admitted):]
            waiting.extendleft(reversed(admitted))
            return None
        self._grow_all(1)  # the first step's blocks are allocated at its start, as in a plain step
        batch = len(running)
        return Span(now, steps, batch, ctx, self.profile.decode_time(batch, ctx))

    def _steps_within_blocks(self, upper: int) -> int:
        """The most steps (≤ upper) the running batch can take before its blocks exceed the budget."""
        def need(k: int) -> int:  # blocks held after k steps (each sequence computes k more tokens)
            return sum(-(-(s.computed + k) // self.bs) - s.blocks for s in self.running)

        free = self.free_blocks
        if len(self.running) * (upper // self.bs + 1) <= free or need(upper) <= free:
            return upper
        lo, hi = 0, upper  # need(lo) <= free < need(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if need(mid) <= free:
                lo = mid
            else:
                hi = mid
        return lo

    def _span_time(self, span: Span, k: int) -> float:
        c = self.profile.decode.per_ctx_token_s
        return span.slow * (k * span.first_step_s + c * span.batch * k * (k - 1) / 2)

    def steps_done_by(self, now: float) -> int:
        """Whole steps of the span in flight finished by `now`."""
        span = self.span
        a, c = span.first_step_s, self.profile.decode.per_ctx_token_s * span.batch
        elapsed = now - span.start
        e = elapsed / span.slow  # in unslowed step time
        if c <= 0:
            return int(e // a) if a > 0 else span.steps
        # k·a + c·k(k−1)/2 ≤ e  →  the positive root of c/2·k² + (a − c/2)·k − e = 0
        half = c / 2
        b = a - half
        k = int((-b + math.sqrt(b * b + 4 * half * e)) / (2 * half))
        while k > 0 and self._span_time(span, k) > elapsed:
            k -= 1
        while k < span.steps and self._span_time(span, k + 1) <= elapsed:
            k += 1
        return k

    def _grow_all(self, k: int) -> None:
        """Every running sequence holds the blocks for `k` more tokens (a span's steps begun)."""
        bs, grown = self.bs, 0
        for s in self.running:
            need = (s.computed + k + bs - 1) // bs - s.blocks
            if need > 0:
                s.blocks += need
                grown += need
        self._take(grown)

    def free_blocks_bound(self, now: float) -> int:
        """A lower bound of the free blocks at `now` without touching the batch (the span's growth so
        far is at most one block a sequence per 16 steps, plus one)."""
        span = self.span
        if span is None:
            return self.free_blocks
        k = min(self.steps_done_by(now) + 1, span.steps)
        return self.free_blocks - len(self.running) * (k // self.bs + 1)

    def sync_span_blocks(self, now: float) -> None:
        """Take the blocks of the span's steps begun by `now` (a plain step takes them at its start):
        what someone looking at this worker's free blocks now must see."""
        span = self.span
        if span is None:
            return
        self._grow_all(min(self.steps_done_by(now) + 1, span.steps))

    def retime(self, now: float, factors: tuple[float, float]) -> float | None:
        """The plain step in flight goes on at `factors` from `now` (its cores shared otherwise than
        when it began). Returns its new end, or None when nothing changes. A decode step keeps its
        pace to its end, as a step of a decode span does (the span is cut there)."""
        if not self.busy or self.span is not None or not self.step_parts[0] or factors == self.step_factors:
            return None
        left = (self.step_end - now) / self._step_duration()  # the fraction of its work still to do
        self.step_end = now + left * self._step_duration(factors)
        self.step_factors = factors
        self.version += 1
        return self.step_end

    def cut_span(self, now: float) -> float | None:
        """Someone joined: end the span at the next step boundary. Returns the new end (or None)."""
        span = self.span
        if span is None or span.steps <= 1:
            return None
        k = min(self.steps_done_by(now) + 1, span.steps)
        if k == span.steps:
            return None
        span.steps = k
        self._grow_all(k)  # blocks of the steps begun by now (what a newcomer must find taken)
        self.step_end = span.start + self._span_time(span, k)
        self.version += 1
        return self.step_end

    def _schedule(self) -> list[tuple[SimSeq, int]]:
        plan: list[tuple[SimSeq, int]] = []
        budget = self.budget
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.computed, budget)
            fits = True
            while not self._grow(seq, seq.computed + n):  # preempt the newest until this one fits
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    fits = False
                    break
            if not fits:
                break
            plan.append((seq, n))
            budget -= n
            i += 1
        if preempted:
            return plan  # memory is tight: admit nobody new this step
        # waiting sequences that hold their KV (imported decode jobs) go first, as in the real
        # scheduler: behind a prompt to compute (a preempted one) they could wait for ever
        for seq in [s for s in self.waiting if s.blocks and s.num_tokens - s.computed == 1]:
            if len(self.running) >= self.max_num_seqs or budget <= 0 or not self._grow(seq, seq.computed + 1):
                break
            self.waiting.remove(seq)
            self.running.append(seq)
            plan.append((seq, 1))
            budget -= 1
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            n = min(seq.num_tokens - seq.computed, budget)
            if not self._grow(seq, seq.computed + n):
                if seq.computed == 0 and seq.blocks:  # don't sit on blocks while waiting
                    self._free(seq)
                break
            self.waiting.popleft()
            self.running.append(seq)
            plan.append((seq, n))
            budget -= n
        return plan

    def _preempt(self, seq: SimSeq) -> None:
        self._free(seq)
        seq.computed = 0  # recomputed from scratch when it is admitted again
        seq.cached = 0
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def _step_parts(self, plan: list[tuple[SimSeq, int]]) -> tuple[float, float]:
        """(prefill part, decode part) of a step's fitted time; sets the step's tokens per event.

        A step that computes a prompt's chunk is one forward pass at prefill rates: its decode rows
        are rows of it (each also reads its KV, as in a decode step), and each is one event: one
        token, or τ on average where the budget the chunk left holds their drafts too (the engine
        verifies drafts in what is left of the budget: shared/engine/engine.py; `_kept`)."""
        p_tokens = p_seqs = batch = ctx = 0
        pairs = 0.0
        for seq, n in plan:
            if n == 1 and seq.num_tokens - seq.computed == 1:
                batch += 1
                ctx += seq.num_tokens
            else:
                p_tokens += n
                p_seqs += 1
                pairs += n * (seq.computed + n / 2)
        prof = self.profile
        self.step_tau = None
        if not p_seqs:
            return 0.0, prof.decode_time(batch, ctx)
        if not batch:
            return prof.prefill_time(p_tokens, pairs, p_seqs), 0.0
        drafts = prof.drafts()
        if prof.tokens_per_event > 1 and self.budget - p_tokens - batch >= batch * drafts:
            self.step_tau = prof.tokens_per_event
        else:
            self.step_tau, drafts = 1.0, 0.0
        return prof.prefill_time(p_tokens, pairs, p_seqs) + prof.riding_decode_time(batch, ctx, drafts), 0.0

    # ------------------------------------------------------------------------------ completion

    def _kept(self, seq: SimSeq) -> int:
        """Tokens a decode row riding on a prompt's chunk keeps: one, or with its drafts verified
        (the chunk left room for them), τ on average (a running credit: whole tokens, τ in the
        mean), as its KV blocks allow."""
        self.spec_credit += self.step_tau
        k = min(seq.remaining, int(self.spec_credit))
        if k > 1 and not self._grow(seq, seq.computed + k - 1):
            k = 1
        self.spec_credit -= k
        return k

    def complete(self, now: float, rec) -> list[SimSeq]:
        """The step or span in flight ended at `now`: tokens out (via `rec`), the finished returned."""
        self.busy = False
        self.busy_s += now - self.step_start
        span, done = self.span, []
        if span is not None:
            self.decode_rows[0] += span.steps * span.batch
            self.decode_rows[1] += span.steps * span.batch * span.batch
            done = rec.decode_span(self, span, now)
            self.span = None
        else:
            b = 0  # the sequences this step decoded (a token each, as _step_parts counts them)
            for seq, n in self.step_plan:
                decoding = n == 1 and seq.num_tokens - seq.computed == 1
                b += decoding
                seq.computed += n
                if seq.computed == seq.num_tokens:  # the step completed its tokens: one is sampled
                    k = self._kept(seq) if decoding and self.step_tau is not None else 1
                    seq.computed += k - 1
                    seq.num_tokens += k
                    seq.remaining -= k
                    rec.token(seq, now, self.step_start, self.step_tau, k)
                    if seq.remaining == 0:
                        done.append(seq)
            self.step_plan = []
            self.decode_rows[0] += b
            self.decode_rows[1] += b * b
        if done:
            for seq in done:
                self._free(seq)
            self.running = [s for s in self.running if s.remaining > 0]
        return done
