"""Speculative decoding: propose a few tokens per decoding sequence, verify them in the batch.

A decode step reads every weight to produce one token per sequence; verifying k proposed tokens
costs the same weight reads and a few more rows of compute. The engine (`LLMEngine.step`) runs a
speculating sequence as a chunk of 1 + k rows — its last token and the k proposals — with logits on
every row, samples each row exactly as a plain step would (same sampler, same per-position seeded
generator) and keeps the proposals up to the first one the sample disagrees with, plus that sample.
So the output is the one speculation-off decoding would give, token for token, greedy or seeded:
for a proposal of probability-one tokens, "keep while the target's own sample matches" *is*
rejection sampling (accept d with probability p(d); on rejection the sample is distributed as
p restricted to the other tokens).

Here live the pieces around that:

- proposers that need no second model — `PromptLookup` (the request's own prompt and output so far)
  and `SuffixCache` (earlier answers on this worker) — and `DraftModelProposer` (a smaller checkpoint
  with its own paged KV, greedy drafts);
- `StepCost` (forward time by rows in the step, calibrated at start, corrected by every step) and
  `Acceptance` (how often proposals of each kind are accepted, per worker and per request);
- `Speculator`, which decides per step how many proposals each sequence verifies: the next proposal
  goes to the sequence whose expected gain (the chance that it and every proposal before it is
  accepted) is largest, as long as that gain per second of extra step time beats the step's own
  tokens per second (by a margin). On text that never matches nothing is proposed; when the batch
  is large enough that rows cost compute, the gain no longer pays for them and k falls to 0 on its
  own.

Everything runs inside the decode worker (and colocated workers); a prefill worker needs nothing,
so disaggregation needs nothing moved.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from shared.config import SpecConfig
from shared.engine.model_runner import ModelRunner, ScheduledChunk
from shared.kvcache.block_pool import BlockPool
from shared.kvcache.kv_cache import KVCache
from shared.kvcache.kv_cache_manager import KVCacheManager

log = logging.getLogger(__name__)

@dataclass
class Proposal:
    tokens: list[int]  # what the proposer would continue with (may be longer than what gets verified)
    source: str  # "prompt" | "suffix" | "draft": its acceptance is tracked per source and match length
    n: int = 0  # length of the matched context (n-gram proposers)

    @property
    def bucket(self) -> tuple[str, int]:
        return self.source, self.n


# ---------------------------------------------------------------------------------- proposers


class NgramIndex:
    """For each n in [n_min, n_max], the latest position where each n-gram of a token list ended.

    `propose(tokens)` matches the list's last n tokens (longest n first) against earlier n-grams
    and returns what followed the latest earlier occurrence."""

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max
        self.last: dict[tuple[int, ...], int] = {}  # n-gram → index just after its latest occurrence
        self.indexed = 0  # n-grams ending before this index are in `last`

    def extend(self, tokens: list[int], upto: int) -> None:
        """Index the n-grams ending before `upto` (exclusive) that are not indexed yet."""
        last = self.last
        for end in range(max(self.indexed, 1), upto):
            for n in range(self.n_min, min(self.n_max, end) + 1):
                last[tuple(tokens[end - n:end])] = end
        self.indexed = max(self.indexed, upto)

    def lookup(self, context: list[int], tokens: list[int], k: int) -> tuple[list[int], int]:
        """What followed the latest indexed occurrence of the longest suffix of `context` (n-grams
        of `tokens`) → (up to k tokens, stopping at a separator; n)."""
        for n in range(min(self.n_max, len(context)), self.n_min - 1, -1):
            at = self.last.get(tuple(context[-n:]))
            if at is not None:
                cont = _until_separator(tokens[at:at + k])
                if cont:
                    return cont, n
        return [], 0


def _until_separator(tokens: list[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t < 0:
            return tokens[:i]
    return tokens


class PromptLookup:
    """Prompt lookup decoding: the request's own tokens (prompt and output so far) as the draft."""

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max

    def propose(self, seq, k: int) -> Proposal | None:
        state = seq.spec.index
        if state is None:
            state = seq.spec.index = NgramIndex(self.n_min, self.n_max)
        tokens = seq.all_token_ids
        # n-grams ending before the last token: the context (the last n tokens) is not its own match
        state.extend(tokens, len(tokens))
        cont, n = state.lookup(tokens, tokens, k)
        return Proposal(cont, "prompt", n) if cont else None


class SuffixCache:
    """Earlier answers on this worker, indexed by n-gram: a request whose output repeats what an
    earlier one said (templates, agent loops, the same code again) gets it proposed.

    Each finished request adds the last `n_max` tokens of its prompt (the context its answer starts
    from) and its output, then a separator. Bounded: past `max_tokens` the older half is dropped."""

    def __init__(self, n_min: int, n_max: int, max_tokens: int):
        self.n_min, self.n_max, self.max_tokens = n_min, n_max, max_tokens
        self.log: list[int] = []
        self.index = NgramIndex(n_min, n_max)

    def add(self, prompt_ids: list[int], output_ids: list[int]) -> None:
        if not output_ids:
            return
        self.log += prompt_ids[-self.n_max:] + output_ids + [-1]
        if len(self.log) > self.max_tokens:
            self.log = self.log[len(self.log) // 2:]
            self.index = NgramIndex(self.n_min, self.n_max)
        self.index.extend(self.log, len(self.log))

    def propose(self, seq, k: int) -> Proposal | None:
        tokens = seq.all_token_ids
        cont, n = self.index.lookup(tokens[-self.n_max:], self.log, k)
        return Proposal(cont, "suffix", n) if cont else None


# ------------------------------------------------------------------------------ cost, acceptance


class StepCost:
    """Seconds a step takes by rows in it: a table measured at start (`calibrate`), interpolated,
    and scaled by how the real steps compare with it (context lengths, the rest of the step)."""

    def __init__(self, table: dict[int, float]):
        self.rows = sorted(table)
        self.secs = [table[r] for r in self.rows]
        self.scale = 1.0

    def __call__(self, rows: int) -> float:
        r, s = self.rows, self.secs
        if rows <= r[0]:
            return s[0] * self.scale
        for i in range(1, len(r)):
            if rows <= r[i]:
                f = (rows - r[i - 1]) / (r[i] - r[i - 1])
                return (s[i - 1] + f * (s[i] - s[i - 1])) * self.scale
        slope = (s[-1] - s[-2]) / (r[-1] - r[-2]) if len(r) > 1 else 0.0
        return (s[-1] + slope * (rows - r[-1])) * self.scale

    def observe(self, rows: int, seconds: float) -> None:
        predicted = self(rows) / self.scale
        if predicted > 0:
            self.scale += 0.05 * (seconds / predicted - self.scale)

    @classmethod
    def calibrate(cls, run_rows: Callable[[int], None], max_rows: int) -> StepCost:
        """Time `run_rows(r)` (a forward of r rows) for r = 1, 2, 4 … max_rows; best of 3."""
        table = {}
        r = 1
        while True:
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                run_rows(r)
                best = min(best, time.perf_counter() - t0)
            table[r] = best
            if r >= max_rows:
                break
            r = min(2 * r, max_rows)
        return cls(table)


@dataclass
class Acceptance:
    """Accepted / verified proposals, decayed so that recent steps count most."""

    accepted: float = 1.4  # an optimistic prior (seven in ten): a kind of proposal is tried before it is judged
    trials: float = 2.0
    decay: float = 0.98

    @property
    def rate(self) -> float:
        return self.accepted / self.trials

    def add(self, accepted: int, verified: int) -> None:
        """`verified` proposals were run, the first `accepted` kept: the trials are the accepted
        ones plus the first rejected one (the rest were never decided on their own)."""
        self.accepted = self.accepted * self.decay + accepted
        self.trials = self.trials * self.decay + accepted + (1 if accepted < verified else 0)


@dataclass
class SeqSpec:
    """A sequence's speculation state (on `Sequence.spec`)."""

    acceptance: Acceptance = field(default_factory=lambda: Acceptance(0.0, 0.0, 0.8))
    index: NgramIndex | None = None  # prompt lookup's index of its tokens
    draft_tokens: int = 0  # proposals verified
    accepted_tokens: int = 0  # of them, kept


@dataclass
class SpecStats:
    """Counters since start (vLLM's spec_decode metrics)."""

    num_drafts: int = 0  # sequence-steps that verified at least one proposal
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [i]: drafts whose proposal i was kept


class Speculator:
    """Chooses, per step, what each decoding sequence verifies; learns from what was accepted."""

    PRIOR_WEIGHT = 4.0  # a request's own history counts once it has about this many trials
    # a proposal's expected tokens per second of extra step time must beat the step's own rate by
    # this factor: the cost model is an estimate (its table comes from a quiet start, real steps
    # have other costs), and a proposal that only breaks even is a loss once it is slightly wrong
    MARGIN = 1.15
    EXPLORE_EVERY = 32  # plans

    def __init__(self, config: SpecConfig, cost: StepCost, draft: DraftModelProposer | None = None):
        self.config = config
        self.cost = cost
        self.prompt = PromptLookup(config.ngram_min, config.ngram_max) if config.mode in ("ngram", "suffix") else None
        self.suffix = (SuffixCache(config.ngram_min, config.ngram_max, config.suffix_cache_tokens)
                       if config.mode == "suffix" else None)
        self.draft = draft
        self.buckets: dict[tuple[str, int], Acceptance] = {}
        self.stats = SpecStats(accepted_per_pos=[0] * config.max_draft)
        self.fixed_k: int | None = None  # tests: verify this many whenever there is a proposal
        self._plans = 0
        self.sample_row_seconds = 0.0  # measured: sampling one row of a non-greedy request

    # ----------------------------------------------------------------------------------- plan

    def propose(self, seqs: list, rows: int, budget: int, max_k: list[int]) -> list[Proposal | None]:
        """What each of `seqs` (decoding sequences in this step, one row each so far) verifies: the
        step has `rows` rows and room for `budget` more; sequence i may take at most max_k[i]."""
        proposals = [self._proposal(s, min(k, self.config.max_draft)) if k > 0 else None
                     for s, k in zip(seqs, max_k)]
        ks = self._plan(seqs, proposals, rows, budget, max_k)
        if self.draft is not None:
            drafted = self.draft.propose(seqs, [k if p is not None else 0 for p, k in zip(proposals, ks)])
            return [Proposal(d, "draft") if d else None for d in drafted]
        return [Proposal(p.tokens[:k], p.source, p.n) if p is not None and k else None for p, k in zip(proposals, ks)]

    def _proposal(self, seq, k: int) -> Proposal | None:
        if self.draft is not None:
            return Proposal([0] * k, "draft")  # drafted after planning: only the length counts here
        best = self.prompt.propose(seq, k) if self.prompt is not None else None
        if self.suffix is not None and (best is None or best.n < self.config.ngram_max):
            other = self.suffix.propose(seq, k)
            if other is not None and (best is None or other.n > best.n):
                best = other
        return best

    def _alpha(self, seq, p: Proposal) -> float:
        bucket = self.buckets.get(p.bucket)
        prior = bucket.rate if bucket is not None else Acceptance().rate
        own = seq.spec.acceptance
        return (own.accepted + self.PRIOR_WEIGHT * prior) / (own.trials + self.PRIOR_WEIGHT)

    def _plan(self, seqs, proposals, rows: int, budget: int, max_k: list[int]) -> list[int]:
        ks = [0] * len(seqs)
        limit = [min(len(p.tokens), mk) if p is not None else 0 for p, mk in zip(proposals, max_k)]
        if self.fixed_k is not None:
            return [min(lim, self.fixed_k) for lim in limit]
        alphas = [self._alpha(s, p) if p is not None else 0.0 for s, p in zip(seqs, proposals)]
        heap = [(-a, i) for i, a in enumerate(alphas) if limit[i] > 0 and a > 0]
        heapq.heapify(heap)
        tokens, secs = float(len(seqs)), self.cost(rows)
        draft_depth = 0
        while heap and budget > 0:
            gain, i = heapq.heappop(heap)
            gain = -gain
            # the measured step time need not be convex in rows (the kernel works in tiles of 4 rows),
            # so the next proposal is judged together with the ones after it: the best run of j more
            best_j, best_gain, best_more, total = 0, 0.0, 0.0, 0.0
            for j in range(1, min(limit[i] - ks[i], budget) + 1):
                total += gain * alphas[i] ** (j - 1)  # expected tokens from these j proposals
                more = self.cost(rows + j) - self.cost(rows)
                if not seqs[i].params.greedy:
                    more += j * self.sample_row_seconds  # its rows are sampled (temperature, top-k/p)
                if self.draft is not None and ks[i] + j > draft_depth:
                    more += (ks[i] + j - draft_depth) * self.draft.pass_seconds  # more draft passes
                if total * secs > self.MARGIN * tokens * more and (best_j == 0 or total * best_more > best_gain * more):
                    best_j, best_gain, best_more = j, total, more
            if best_j == 0:
                break  # its tokens per second of extra time no longer beat the step's (tokens / secs) enough
            ks[i] += best_j
            draft_depth = max(draft_depth, ks[i])
            rows, budget, tokens, secs = rows + best_j, budget - best_j, tokens + best_gain, secs + best_more
            if ks[i] < limit[i]:
                heapq.heappush(heap, (-gain * alphas[i] ** best_j, i))
        self._plans += 1
        if self._plans % self.EXPLORE_EVERY == 0 and not any(ks):
            # now and then one proposal is verified anyway: acceptance judged too low is measured again
            best = max(range(len(seqs)), key=lambda i: alphas[i] if limit[i] else -1.0)
            if limit[best] and budget > 0:
                ks[best] = 1
        return ks

    # ---------------------------------------------------------------------------------- learn

    def observe(self, seq, proposal: Proposal, accepted: int, kept_kv: int) -> None:
        """`seq` verified `proposal` and kept its first `accepted` tokens; its KV holds `kept_kv` tokens."""
        verified = len(proposal.tokens)
        seq.spec.acceptance.add(accepted, verified)
        seq.spec.draft_tokens += verified
        seq.spec.accepted_tokens += accepted
        self.buckets.setdefault(proposal.bucket, Acceptance()).add(accepted, verified)
        if self.draft is not None:
            self.draft.rollback(seq, kept_kv)
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += verified
        s.num_accepted_tokens += accepted
        for i in range(accepted):
            s.accepted_per_pos[i] += 1

    def observe_sampling(self, rows: int, seconds: float) -> None:
        self.sample_row_seconds += 0.1 * (seconds / rows - self.sample_row_seconds)

    def discard(self, seq) -> None:
        """`seq` will not verify what was proposed this step (no blocks for the rows)."""
        if self.draft is not None:
            self.draft.rollback(seq, seq.num_tokens)

    def finished(self, seq, complete: bool) -> None:
        """A sequence is done (`complete`: not aborted): what it said joins the suffix cache; a draft
        model frees its KV."""
        if self.suffix is not None and complete and seq.output_ids:
            self.suffix.add(seq.prompt_ids, seq.output_ids)
        if self.draft is not None:
            self.draft.forget(seq)


# ------------------------------------------------------------------------------- draft model


class DraftModelProposer:
    """A smaller model of the same vocabulary drafts greedily, with its own paged KV cache.

    Per step: one pass catches each speculating sequence up (the tokens the draft has not seen:
    on first use its whole prompt, later the tokens accepted since), then one more pass per further
    draft token, batched over the sequences. After verification its KV is cut back to what the
    target kept (`rollback`)."""

    CATCH_UP_TOKENS = 512  # most tokens one sequence feeds the draft in one step

    def __init__(self, model, num_blocks: int, block_size: int, kv_dtype: torch.dtype, fused: bool = True):
        self.model = model
        self.kv_cache = KVCache(model.config, num_blocks, block_size, dtype=kv_dtype, device="cpu")
        self.pool = BlockPool(num_blocks, enable_prefix_caching=False)
        self.kv = KVCacheManager(self.pool, block_size, model.config.name + "-draft")
        self.runner = ModelRunner(model, self.kv_cache, fused=fused)
        self.states: dict[str, _DraftSeq] = {}
        self.pass_seconds = 0.0  # measured: one batched draft pass

    def propose(self, seqs: list, want: list[int]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in seqs]
        active = []
        for i, (seq, k) in enumerate(zip(seqs, want)):
            if k <= 0:
                continue
            st = self.states.get(seq.request_id)
            if st is None:
                st = self.states[seq.request_id] = _DraftSeq(seq)
            st.seq = seq
            todo = seq.num_tokens - st.num_computed_tokens
            if todo > self.CATCH_UP_TOKENS:  # a long prompt: catch up over several steps, no drafts yet
                n = self.CATCH_UP_TOKENS
                if self.kv.allocate_slots(st, n):
                    active.append((i, st, n, 0))
                continue
            if not self.kv.allocate_slots(st, todo + k - 1):
                continue
            active.append((i, st, todo, k))
        if not active:
            return out
        t0 = time.perf_counter()
        chunks = [ScheduledChunk(st.all_token_ids[st.num_computed_tokens:st.num_computed_tokens + n],
                                 st.num_computed_tokens, st.block_table, int(k > 0)) for _, st, n, k in active]
        logits = self.runner.execute(chunks)
        for _, st, n, _ in active:
            st.num_computed_tokens += n
        drafting = [(i, st, k) for i, st, _, k in active if k > 0]
        last = logits.argmax(-1).tolist()
        for (i, _, _), t in zip(drafting, last):
            out[i].append(t)
        passes = 1
        for depth in range(1, max((k for _, _, k in drafting), default=0)):
            step = [(i, st) for i, st, k in drafting if k > depth]
            chunks = [ScheduledChunk([out[i][-1]], st.seq.num_tokens + depth - 1, st.block_table) for i, st in step]
            nxt = self.runner.execute(chunks).argmax(-1).tolist()
            for (i, _), t in zip(step, nxt):
                out[i].append(t)
            passes += 1
        for i, st, k in drafting:  # it has KV for the proposals it was fed (all but the last)
            st.num_computed_tokens += k - 1
        self.pass_seconds += 0.2 * ((time.perf_counter() - t0) / passes - self.pass_seconds)
        return out

    def rollback(self, seq, kept: int) -> None:
        """The target kept KV for its first `kept` tokens: the draft's KV past that is stale."""
        st = self.states.get(seq.request_id)
        if st is None:
            return
        st.num_computed_tokens = min(st.num_computed_tokens, kept)
        self.kv.trim(st)

    def forget(self, seq) -> None:
        st = self.states.pop(seq.request_id, None)
        if st is not None:
            self.kv.free(st)


class _DraftSeq:
    """The draft model's view of a target sequence (the KVCacheManager's HasBlocks)."""

    def __init__(self, seq):
        self.seq = seq
        self.block_table: list[int] = []
        self.block_keys: list = []
        self.num_computed_tokens = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.seq.all_token_ids
