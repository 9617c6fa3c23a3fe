"""Where each job goes: which worker, and (conditional mode) which pool prefills it.

    cost(w) = tokens w must still compute for this prompt + load(w)           (cache-aware)
    load(w) = prompt tokens queued at w (its stats) + tokens this gateway sent w that its stats do
              not show yet + DECODE_WEIGHT × KV tokens its running sequences hold (decode-side roles)
    busy(w) = requests running and waiting at w + jobs sent and not in its stats yet

The prompt's cached blocks at w are the longer of the prefixes held by w's own engine cache and (a
prefill worker) by its host's kvstore (the routing index, `prefix_index.py`). Cache-aware routing is Dynamo's KV-router
cost (overlap-weighted blocks to prefill + active blocks) with SGLang's guard against the "death
spiral": a worker busier than the mean by `hot_spot_factor` (and by HOT_MIN_REQUESTS more than the
least busy) is not chosen for its cache — its cached blocks do not count — so a popular prefix
spreads to a second worker instead of piling its streams onto the first. The guard counts requests,
not tokens: a cached prompt costs its holder little to start, but every stream it keeps there
slows that worker's steps for all of them. Ties go to the less loaded, then in turn.
`least-loaded` is the cost without the cache term; `round-robin` takes live workers in turn.

The job goes to the chosen worker's own subject (pd.prefill.jobs.<inst>, pd.decode.direct.<inst>);
the shared queue stays the fallback: no live worker known → shared queue, and a chosen worker that
dies before taking the job has it resubmitted there by the request's channel (dispatch.py).

Conditional mode decides per request, from the prompt's *uncached* length at the best decode
worker: fewer than `conditional_threshold` tokens → that decode worker prefills it itself; fewer
than `conditional_busy_threshold` while the prefill pool has more than `conditional_queue_tokens`
queued → also decode (waiting there would cost more than computing here); else the prefill pool.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

from services.gateway.config import GatewayConfig
from services.gateway.prefix_index import PrefixIndex
from shared.kvcache.block_hash import block_keys
from shared.protocol import subjects
from shared.protocol.messages import WorkerStats

# A KV token a running sequence holds, against a prompt token still to compute: what a running
# sequence adds to the wait of a new prompt is its share of each step (one row, attention over its
# context), small beside computing its whole context again — a 900-token conversation weighs 45
# prompt tokens. (Dynamo weighs a decode block like a block to prefill; on a GPU the KV budget is
# what binds, on this CPU the prefill compute is.)
DECODE_WEIGHT = 0.05
HOT_MIN_REQUESTS = 4  # a worker is a hot spot only with at least this many more requests than the least busy


@dataclass(frozen=True)
class Route:
    subject: str  # where the job is published
    target: str = ""  # the worker chosen ("": the shared queue, any worker of the pool)
    pool: str = "prefill"  # prefill | decode (conditional: prefilled by a decode worker) | colocated
    cached_tokens: int = 0  # what the router expects the target to find cached
    # cache | load | turn | hot-spot | shared (no live worker known); conditional: short | cached (at
    # least half the prompt cached at the decode worker) | busy | long
    reason: str = ""
    tokens: int = 0  # tokens the target must compute (its pending load until its stats show the job)
    job: int = -1  # this gateway's number for the job (its pending entry)


@dataclass
class _Candidate:
    stats: WorkerStats
    cached_blocks: int
    load: float  # in prompt tokens
    busy: int  # in requests


class Router:
    def __init__(self, config: GatewayConfig, index: PrefixIndex, live_workers, model_id: str, block_size: int = 16,
                 heard_at=None):
        """`live_workers(role)`: the latest WorkerStats of each live worker of that role;
        `heard_at(role, instance)`: when those arrived (time.monotonic())."""
        self.config, self.index, self.live_workers = config, index, live_workers
        self.model_id, self.block_size = model_id, block_size
        self.heard_at = heard_at
        # instance → job → [tokens, taken at]: what this gateway sent there that the worker's stats do
        # not show yet — until a report arrives that was made after the worker took the job
        self.pending: dict[str, dict[int, list]] = {}
        self._turn = itertools.count()
        self._jobs = itertools.count()

    # ------------------------------------------------------------------------------------ routing

    def route(self, prompt_ids: list[int]) -> Route:
        cfg = self.config
        n = len(prompt_ids)
        # a worker computes at least the last token: only blocks before it can be hits
        keys = block_keys(prompt_ids[:n - 1], self.block_size, self.model_id) if n > 1 else []
        matches = self.index.match(keys) if keys else {}
        if cfg.mode == "colocated":
            chosen = self._choose("colocated", subjects.PREFILL_JOBS, n, matches)
            return self._take(chosen) if chosen else Route(subjects.PREFILL_JOBS, pool="colocated", reason="shared")
        if cfg.mode == "conditional":
            # no decode worker's stats heard yet (a gateway just started): any of them, by length alone
            direct = self._choose("decode", subjects.DECODE_DIRECT, n, matches) or Route(subjects.DECODE_DIRECT)
            uncached = n - direct.cached_tokens
            if uncached < cfg.conditional_threshold:
                mostly_cached = 2 * direct.cached_tokens >= n
                return self._take(direct, reason="cached" if mostly_cached else "short", pool="decode")
            if uncached < cfg.conditional_busy_threshold and self.queued("prefill") > cfg.conditional_queue_tokens:
                return self._take(direct, reason="busy", pool="decode")
            chosen = self._choose("prefill", subjects.PREFILL_JOBS, n, matches)
            return self._take(chosen, reason="long") if chosen else Route(subjects.PREFILL_JOBS, reason="long")
        chosen = self._choose("prefill", subjects.PREFILL_JOBS, n, matches)
        return self._take(chosen) if chosen else Route(subjects.PREFILL_JOBS, reason="shared")

    def _choose(self, role: str, base: str, n: int, matches: dict[str, int]) -> Route | None:
        """The best live worker of `role` for an n-token prompt (None: none is known)."""
        cands = [self._candidate(s, matches) for s in self.live_workers(role) if not s.draining]
        if not cands:
            return None
        turn = next(self._turn)
        order = {c.stats.instance: (i - turn) % len(cands)
                 for i, c in enumerate(sorted(cands, key=lambda c: c.stats.instance))}
        policy = self.config.router
        if policy == "round-robin":
            best, reason = min(cands, key=lambda c: order[c.stats.instance]), "turn"
        else:
            mean = sum(c.busy for c in cands) / len(cands)
            least = min(c.busy for c in cands)
            hot = {c.stats.instance for c in cands
                   if c.busy - least >= HOT_MIN_REQUESTS and c.busy > self.config.hot_spot_factor * mean}

            def cached(c: _Candidate) -> int:
                if policy != "cache-aware" or c.stats.instance in hot:
                    return 0
                return min(c.cached_blocks * self.block_size, n - 1)

            best = min(cands, key=lambda c: (n - cached(c) + c.load, c.load, order[c.stats.instance]))
            if cached(best):
                reason = "cache"
            elif policy == "cache-aware" and any(c.cached_blocks and c.stats.instance in hot for c in cands):
                reason = "hot-spot"
            else:
                reason = "load"
        cached_tokens = min(best.cached_blocks * self.block_size, n - 1) if reason == "cache" else 0
        return Route(subjects.worker_jobs(base, best.stats.instance), best.stats.instance, role, cached_tokens,
                     reason, n - cached_tokens)

    def _candidate(self, s: WorkerStats, matches: dict[str, int]) -> _Candidate:
        blocks = matches.get(subjects.cache_location("worker", s.instance), 0)
        if s.kvstore and s.role == "prefill":  # a prefill worker reads its host store's prefixes; a
            # decode worker prefilling a whole prompt (conditional) has only its engine's
            blocks = max(blocks, matches.get(subjects.cache_location("store", s.kvstore), 0))
        return _Candidate(s, blocks, self.load(s), self.busy(s))

    def load(self, s: WorkerStats) -> float:
        active = s.kv_blocks_in_use * self.block_size if s.role in ("decode", "colocated") else 0
        return s.queued_tokens + self.pending_tokens(s) + DECODE_WEIGHT * active

    def busy(self, s: WorkerStats) -> int:
        return s.running + s.waiting + len(self._pending_jobs(s))

    def queued(self, role: str) -> int:
        """Prompt tokens waiting in the pool of `role` (reported, plus sent and not in a report yet)."""
        return sum(s.queued_tokens + self.pending_tokens(s) for s in self.live_workers(role))

    def pending_tokens(self, s: WorkerStats) -> int:
        return sum(tokens for tokens, _ in self._pending_jobs(s).values())

    def _pending_jobs(self, s: WorkerStats) -> dict[int, list]:
        jobs = self.pending.get(s.instance)
        if not jobs:
            return {}
        heard = self.heard_at(s.role, s.instance) if self.heard_at is not None else float("inf")
        for job in [j for j, (_, taken_at) in jobs.items() if taken_at is not None and heard > taken_at]:
            del jobs[job]  # the worker's own report counts it now
        if not jobs:
            del self.pending[s.instance]
        return jobs

    def _take(self, route: Route, *, reason: str | None = None, pool: str | None = None) -> Route:
        job = next(self._jobs)
        if route.target:
            self.pending.setdefault(route.target, {})[job] = [route.tokens, None]
        return Route(route.subject, route.target, pool or route.pool, route.cached_tokens, reason or route.reason,
                     route.tokens, job)

    def taken(self, route: Route) -> None:
        """The target took the job (or the request ended first): its next report counts it."""
        entry = self.pending.get(route.target, {}).get(route.job)
        if entry is not None and entry[1] is None:
            entry[1] = time.monotonic()
