"""The event loop: requests arrive, are routed, prefilled, their KV moved, decoded, finished.

    arrival ──▶ prefill queue ──(a worker with room pulls)──▶ prefill engine (chunked, batched)
                                                                   │ token 1 (TTFT); KV write
                decode queue ◀──────────────── KV stored ◀─────────┘
                     │ (a decode worker with a free slot and free blocks pulls; KV read, one at a time)
                     │ (too big for it beside its running requests: handed back once; back again, it waits
                     │  there, unread, until it fits or another worker has room: handed on once more)
                     ▼
                decode engine (continuous batching, block budget, preemption) ──▶ finished

Modes as in `pdserve up`: disaggregated (above), colocated (every worker takes whole requests from
the prefill queue), conditional (prompts shorter than the threshold go to a decode worker whole).
Queues are JetStream work queues in the real system: a worker pulls only when it has room, and a
job waits for the first one that does (workers with room wait in a FIFO, like fetchers).
The prefix cache is the kvstore's index: LRU over prompt-prefix keys, one store's capacity per host.

Pools can change size while it runs (`Cluster(scaler=...)`): every `interval_s` the scaler sees the
arrivals so far and names a target per pool. A worker added costs GPU time from the decision and
takes jobs `startup_s` later (its model loading); a worker removed drains — it takes no new job,
finishes what it holds, then leaves. Cost is GPU time over each worker's life, so a fleet that
follows the load is charged for the workers it had, when it had them.

Engines on one CPU host (a CPU profile) share its cores as `pdserve up`'s do (shared/sim/cores.py):
each has a share, idle ones lend theirs, and a step's pace follows the cores it gets. A real worker
takes its threads as a step begins and keeps them to its end; when engines begin or cease to hold
sequences the cores are divided anew: a step with a prompt's chunk in flight goes on at its new
pace, a decode step (or a decode span, cut there) at its next step.

The prefill pool may run on a profile of its own (`Cluster(prefill_profile=...)`: the same model on
another tensor-parallel group, say): its workers' steps, KV writes and GPUs come from it, and
everything a decode worker does from the main profile.

Events sit in one heap as (time, sequence number, type, payload); a worker's step carries the
worker's version, and an event whose version is stale (its span was cut short) is dropped.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from shared.config import pull_reserve
from shared.sim.cores import HostCores
from shared.sim.cost import Profile
from shared.sim.engine import SimEngine, SimSeq
from shared.sim.metrics import Recorder
from shared.sim.workload import Load, SimRequest

MODES = ("disaggregated", "colocated", "conditional")
ARRIVE, STEP, KV_STORED, JOIN, WAKE, TICK, READY = range(7)
HAND_BACK_PAUSE_S = 0.2  # a decode worker that handed a job back pulls nothing this long (the real one's)
SLO_WINDOW_S = 300.0  # a scaled run reports its SLO attainment per this much of arrivals


@dataclass(frozen=True)
class ClusterConfig:
    mode: str = "disaggregated"
    prefill: int = 1  # prefill workers (colocated: unused)
    decode: int = 1  # decode workers (colocated: engine workers)
    kv_path: str = "shm"  # "shm" | "network": the profile's transfer fit to use
    max_num_batched_tokens: int | None = None  # None: the profile's
    max_num_seqs: int | None = None
    num_kv_blocks: int | None = None
    prefill_max_inflight: int | None = None
    prefix_caching: bool = True
    conditional_threshold: int = 256
    decode_pull_batch: int = 1  # a decode worker takes at most this many jobs per pull (the real one: 1)
    gpus_per_host: int = 8  # workers sharing one kvstore (prefix-cache capacity per host)
    decode_spans: bool = True  # false: every decode step its own event (slow; tests compare the two)
    # false: every engine of a CPU profile on cores of its own (a probe of the work a load brings,
    # not of a deployment: `pdserve plan`'s roomy pools would share 2 cores six ways)
    shared_cores: bool = True

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.decode < 1 or (self.mode != "colocated" and self.prefill < 1):
            raise ValueError(f"{self.mode} needs at least one worker of each pool it uses")
        for name in ("max_num_batched_tokens", "max_num_seqs", "num_kv_blocks", "prefill_max_inflight"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")

    @property
    def num_workers(self) -> int:
        return self.decode + (0 if self.mode == "colocated" else self.prefill)


@dataclass
class ClosedLoop:
    """`concurrency` clients sending back to back until `window_s` (bench's interference chat streams),
    or until `max_requests` are sent (bench's closed loop of a number of requests)."""

    make: Any  # index -> SimRequest (arrival ignored)
    concurrency: int
    window_s: float
    max_requests: int | None = None
    next_index: Iterator[int] = field(default_factory=itertools.count)
    sent: int = 0


class Scaler(Protocol):
    """Sizes the pools while a simulation runs (services/planner/forecast.py)."""

    interval_s: float  # a decision this often
    startup_s: float  # from a decision to add a worker until it takes jobs

    def targets(self, now: float, arrived: int, waiting: tuple[int, int], load: Load | None = None) -> tuple[int, int]:
        """(prefill, decode) workers wanted, from the arrivals so far, the jobs waiting now for a
        worker of each pool and the work done so far (`load`: running totals) — what a gateway's
        metrics show (colocated: prefill ignored)."""
        ...


class PrefixCache:
    """LRU over prefix keys, capacity in keys (each a block of the request's key size)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.keys: OrderedDict = OrderedDict()
        self.queried_tokens = self.hit_tokens = 0

    def match(self, req: SimRequest) -> int:
        """Tokens of the request's prompt whose KV is cached (a whole leading run of keys)."""
        n = 0
        for key in req.prefix_keys:
            if key not in self.keys:
                break
            self.keys.move_to_end(key)
            n += 1
        hit = min(n * req.prefix_key_tokens, req.prompt_tokens - 1)
        hit -= hit % 16
        self.queried_tokens += len(req.prefix_keys) * req.prefix_key_tokens
        self.hit_tokens += hit
        return max(hit, 0)

    def insert(self, req: SimRequest) -> None:
        for key in req.prefix_keys:
            self.keys[key] = None
            self.keys.move_to_end(key)
        self.resize(self.capacity)

    def resize(self, capacity: int) -> None:
        """A host joined or left: its store's memory with it (the least recently used go first)."""
        self.capacity = capacity
        while len(self.keys) > capacity:
            self.keys.popitem(last=False)


class Cluster:
    def __init__(self, profile: Profile, config: ClusterConfig, kinds: Iterable[str] = ("chat", "long"),
                 itl_from_s: float | None = None, scaler: Scaler | None = None,
                 prefill_profile: Profile | None = None):
        self.profile, self.config = profile, config
        self.prefill_profile = prefill_profile or profile
        lim = profile.limits
        if config.mode == "colocated" and prefill_profile is not None:
            raise ValueError("a colocated cluster has one pool: no prefill profile of its own")
        pl = self.prefill_profile.limits
        if (pl.block_size, pl.kv_bytes_per_block) != (lim.block_size, lim.kv_bytes_per_block):
            raise ValueError("the prefill profile's KV blocks differ from the decode profile's: not the same model")
        self.block_bytes = lim.kv_bytes_per_block
        self.bs = lim.block_size
        self.wids = itertools.count()
        self.scaler = scaler
        self.retired: list[SimEngine] = []  # drained workers that left, for the cost
        self.starting: dict[str, list[SimEngine]] = {"prefill": [], "decode": []}  # added, still loading
        self.scale_log: list[tuple[float, int, int]] = []  # (time, prefill, decode) after each change
        if config.mode == "colocated":
            self.prefill_pool: list[SimEngine] = []
            self.decode_pool = [self._new_worker("decode", 0.0) for _ in range(config.decode)]
        else:
            self.prefill_pool = [self._new_worker("prefill", 0.0) for _ in range(config.prefill)]
            self.decode_pool = [self._new_worker("decode", 0.0) for _ in range(config.decode)]
        self.max_inflight = config.prefill_max_inflight or lim.prefill_max_inflight
        # the engines on one CPU host's cores, lending them while idle (shared/sim/cores.py); None: a
        # GPU each, nothing shared
        self.host = HostCores(profile.host_cores() or 2, config.num_workers, profile.unlent,
                              wide=profile.decode_wide is not None) \
            if config.shared_cores and (profile.meta.get("device") == "cpu" or profile.unlent != (1.0, 1.0)) else None
        self.cache = PrefixCache(self._cache_capacity()) if config.prefix_caching else None
        self.kind_names = list(kinds)
        self.kind_ids = {k: i for i, k in enumerate(self.kind_names)}
        self.rec = Recorder(self.kind_names, itl_from_s, profile.tokens_per_event, profile.itl_shape)
        self.reqs: list[SimRequest] = []
        self.heap: list = []
        self.seq_no = itertools.count()
        self.prefill_q: deque[int] = deque()  # request ids (whole requests in colocated mode)
        self.decode_q: deque[int] = deque()  # decode jobs (KV stored)
        self.direct_q: deque[int] = deque()  # conditional: whole short requests for decode workers
        self.hungry_prefill: deque[SimEngine] = deque()
        self.hungry_decode: deque[SimEngine] = deque()
        self.kv_stats = {"transfers": 0, "bytes": 0, "write_s": 0.0, "read_s": 0.0, "handed_back": 0, "waited": 0}
        self.handed_back: dict[int, list[int]] = {}  # decode job -> the workers that handed it back, each time
        self.waiting: set[SimEngine] = set()  # decode workers with a job waiting, unread, for room
        self.closed: ClosedLoop | None = None
        self.closed_ids: set[int] = set()
        self.events = 0
        self.max_events = 10**9
        self.now = 0.0
        self.arrived = 0
        # work done, as the gateway's counters total it (what a scaler sizes the pools by): work_done()
        self.load = {"finished": 0, "prompt_tokens": 0, "output_tokens": 0, "prefilled": 0, "prefill_s": 0.0}

    def _new_worker(self, pool: str, t: float) -> SimEngine:
        """A worker of `pool` ("prefill" | "decode": in colocated mode the engine workers), alive from `t`."""
        cfg = self.config
        role = "colocated" if cfg.mode == "colocated" else pool
        profile = self.prefill_profile if role == "prefill" else self.profile
        lim = profile.limits
        blocks = lim.num_kv_blocks if role == "prefill" else cfg.num_kv_blocks or lim.num_kv_blocks
        w = SimEngine(next(self.wids), role, profile, blocks, cfg.max_num_seqs or lim.max_num_seqs,
                      cfg.max_num_batched_tokens or lim.max_num_batched_tokens, cfg.decode_spans)
        w.born_s = t
        return w

    def _cache_capacity(self) -> int:
        # in workers of the main profile's size (a prefill pool of half-size workers fills hosts half as fast)
        gpus = len(self.prefill_pool) * self.prefill_profile.limits.gpus_per_worker + \
            len(self.decode_pool) * self.profile.limits.gpus_per_worker
        workers = gpus / self.profile.limits.gpus_per_worker
        return self.profile.limits.kvstore_slots * max(1, math.ceil(workers / self.config.gpus_per_host))

    # ------------------------------------------------------------------------------------ run

    def run(self, arrivals: Iterable[SimRequest], closed: ClosedLoop | None = None,
            check_every: int = 0) -> None:
        """Serve every request to its end. `check_every` > 0: check the invariants that often."""
        self.closed = closed
        if isinstance(arrivals, list):  # a livelock guard: generous, but a run must end
            self.max_events = 50_000 * (len(arrivals) + (closed.concurrency if closed else 0)) + 10**6
        it = iter(arrivals)
        self._next_arrival(it)
        for w in self.prefill_pool + self.decode_pool:  # before the closed loop's first requests come
            self._mark_hungry(w)
        if closed is not None:
            for _ in range(closed.concurrency):
                self._closed_next(0.0)
        if self.scaler is not None:
            self._push(0.0, TICK, None)
        heap, pop = self.heap, heapq.heappop
        while heap:
            t, _, typ, a, b = pop(heap)
            self.now = t
            self.events += 1
            if typ == STEP:
                if b == a.version and a.busy:
                    self._on_step(a, t)
            elif typ == ARRIVE:
                rid = self._arrive(a, t)
                if b is None:  # a closed loop's next request
                    self.closed_ids.add(rid)
                else:
                    self._next_arrival(b)
            elif typ == KV_STORED:
                self._on_kv_stored(a, b, t)
            elif typ == JOIN:
                self._on_join(a, b, t)
            elif typ == WAKE:  # a worker's pause after a hand-back is over
                self._pull(a, t)
            elif typ == TICK:
                self._tick(t)
            elif typ == READY:
                self._ready(a, b, t)
            if self.host is not None:
                self._share_cores(t)
            if check_every and self.events % check_every == 0:
                self.check_invariants()
            if self.events > self.max_events:
                raise RuntimeError(f"no progress after {self.events} events (a worker's KV budget too small for "
                                   f"its jobs?); {len(self.rec.arrival)} requests so far")

    def _push(self, t: float, typ: int, a, b=None) -> None:
        heapq.heappush(self.heap, (t, next(self.seq_no), typ, a, b))

    def _next_arrival(self, it: Iterator[SimRequest]) -> None:
        req = next(it, None)
        if req is not None:
            self._push(req.arrival_s, ARRIVE, req, it)

    def _closed_next(self, t: float) -> None:
        """A closed-loop client's next request, sent when it has seen the last one end: it comes to
        the engines the profile's per-request overhead later (the way out and back in)."""
        c = self.closed
        if t >= c.window_s or c.max_requests is not None and c.sent >= c.max_requests:
            return
        c.sent += 1
        req = c.make(next(c.next_index))
        req.arrival_s = t
        self._push(t, ARRIVE, req, None)

    # -------------------------------------------------------------------------------- routing

    def _arrive(self, req: SimRequest, t: float) -> int:
        kind = self.kind_ids.get(req.kind)
        if kind is None:
            kind = self.kind_ids[req.kind] = len(self.kind_names)
            self.kind_names.append(req.kind)
            self.rec.hists.append(type(self.rec.hists[0])())
        rid = self.rec.new_request(req.arrival_s, req.prompt_tokens, req.output_tokens, kind)
        self.reqs.append(req)
        self.arrived += 1
        if self.config.mode == "conditional" and req.prompt_tokens < self.config.conditional_threshold:
            self.direct_q.append(rid)
            self._feed(self.direct_q, self.hungry_decode, t)
        else:
            self.prefill_q.append(rid)
            pool = self.hungry_decode if self.config.mode == "colocated" else self.hungry_prefill
            self._feed(self.prefill_q, pool, t)
        return rid

    def _feed(self, queue: deque, hungry: deque, t: float) -> None:
        """Jobs wait in `queue`; workers with room (in `hungry`) pull them."""
        while queue and hungry:
            w = hungry.popleft()
            w.hungry = False
            if not w.draining:
                self._pull(w, t)

    def _mark_hungry(self, w: SimEngine) -> None:
        if not w.hungry and not w.draining and self._room(w) > 0:
            w.hungry = True
            (self.hungry_prefill if w.role == "prefill" else self.hungry_decode).append(w)

    def _room(self, w: SimEngine) -> int:
        if w.role == "prefill":
            return self.max_inflight - w.held - w.num_requests
        if self.now < w.paused_until:
            return 0
        slots = min(w.max_num_seqs - w.num_requests - w.held, self.config.decode_pull_batch)
        if slots <= 0:
            return 0
        reserve = pull_reserve(w.total_blocks)  # as the decode worker: headroom for running sequences
        if w.span is not None and w.free_blocks_bound(self.now) <= reserve:
            w.sync_span_blocks(self.now)  # close to the line: count exactly
        elif w.span is not None:
            return slots
        return slots if w.free_blocks > reserve else 0

    def _pull(self, w: SimEngine, t: float) -> None:
        if w.draining:
            if not w.busy:
                self._plan(w, t)
            self._retire_if_done(w, t)
            return
        room = self._room(w)
        if w.role == "decode" and w.held:  # still reading the previous pull's KV
            return
        queues = (self.prefill_q,) if w.role in ("prefill", "colocated") else (self.decode_q, self.direct_q)
        handed_back = False
        for q in queues:
            while room > 0 and q:
                rid = q.popleft()
                if q is self.decode_q and self._hand_back(w, rid, t):
                    handed_back, room = True, 0
                    break
                if q is self.decode_q and self._no_room_for(w, rid, t):  # it came back: it waits here,
                    w.unread.append(rid)                                     # taking nothing else
                    w.held += 1
                    self.waiting.add(w)
                    self.kv_stats["waited"] += 1
                    room = 0
                    break
                self._take(w, rid, q is self.decode_q, t)
                room -= 1
        if room > 0:
            self._mark_hungry(w)
        if not w.busy:
            self._plan(w, t)
        if handed_back:  # for a worker with room (this one pulls again after its pause)
            self._feed(self.decode_q, self.hungry_decode, t)

    def _need(self, w: SimEngine, rid: int) -> int:
        return w.blocks_for(self.reqs[rid].prompt_tokens + 1)  # the prompt and its first token

    def _no_room_for(self, w: SimEngine, rid: int, t: float) -> bool:
        """`w`'s running requests leave too few blocks for decode job `rid` (counted exactly)."""
        need = self._need(w, rid)
        if not w.num_requests or w.free_blocks_bound(t) >= need:
            return False
        w.sync_span_blocks(t)
        return w.free_blocks < need

    def _hand_back(self, w: SimEngine, rid: int, t: float) -> bool:
        """As the real decode worker: a job whose prompt does not fit in the blocks left beside the
        worker's running requests goes back to the end of the decode queue, once per worker. True if
        it was handed back."""
        if w.wid in self.handed_back.get(rid, ()) or not self._no_room_for(w, rid, t):
            return False
        self._requeue(w, rid, t)
        return True

    def _requeue(self, w: SimEngine, rid: int, t: float) -> None:
        """`w` puts decode job `rid` back at the end of the queue and pulls nothing for HAND_BACK_PAUSE_S."""
        self.handed_back.setdefault(rid, []).append(w.wid)
        self.kv_stats["handed_back"] += 1
        self.decode_q.append(rid)
        w.paused_until = t + HAND_BACK_PAUSE_S
        self._push(w.paused_until, WAKE, w)

    def _unblock(self, w: SimEngine, t: float) -> None:
        """`w`'s requests freed blocks: the jobs waiting on it go on (those read join its engine, those
        unread are read), as they fit."""
        while w.waiting_jobs and w.import_seq(w.waiting_jobs[0]):
            w.waiting_jobs.popleft()
            w.held -= 1
        while w.unread and not self._no_room_for(w, w.unread[0], t):
            w.held -= 1
            self._take(w, w.unread.popleft(), True, t)
        if not w.unread:
            self.waiting.discard(w)

    def _put_back_unread(self, w: SimEngine, t: float) -> None:
        """A decode worker told to drain puts the jobs waiting unread on it back in the queue at once
        (the real one naks them: JetStream delivers a nak'd job before the newer ones)."""
        while w.unread:
            self.decode_q.appendleft(w.unread.pop())
            w.held -= 1
        if w in self.waiting:
            self.waiting.discard(w)
            self._feed(self.decode_q, self.hungry_decode, t)

    def _offer_waiting(self, v: SimEngine, t: float) -> None:
        """Decode worker `v` has room now: a job waiting unread on another worker for room there is
        handed on to the queue for it (as the real worker does when a peer's stats show room: at
        most twice a job per worker)."""
        for w in list(self.waiting):
            if w is v or v.draining or self._room(v) <= 0:
                continue
            rid = w.unread[0]
            if self.handed_back[rid].count(w.wid) < 2 and v.free_blocks >= self._need(v, rid):
                w.unread.popleft()
                w.held -= 1
                if not w.unread:
                    self.waiting.discard(w)
                self._requeue(w, rid, t)
                self._feed(self.decode_q, self.hungry_decode, t)

    def _take(self, w: SimEngine, rid: int, prefilled: bool, t: float) -> None:
        req = self.reqs[rid]
        kind = self.rec.kind[rid]
        if prefilled:  # a decode job: read the KV (one read at a time per worker), then join
            self.handed_back.pop(rid, None)
            read = w.profile.transfer_time(self.config.kv_path, self._kv_bytes(req.prompt_tokens))[1]
            start = max(t, w.intake_free_s)
            w.intake_free_s = start + read
            w.held += 1
            self.kv_stats["read_s"] += read
            seq = SimSeq(rid, kind, req.prompt_tokens + 1, req.prompt_tokens, req.output_tokens - 1, False)
            self._push(start + read, JOIN, w, seq)
            return
        prefill_only = w.role == "prefill"
        cached = self.cache.match(req) if self.cache is not None and req.prefix_keys else 0
        self.load["prefilled"] += 1  # counted as its prefill starts (a gateway counts a request as it ends)
        self.load["prompt_tokens"] += req.prompt_tokens
        if not prefill_only:  # a whole request: its prompt's time alone (a prefill worker's steps count in full)
            new = req.prompt_tokens - cached
            self.load["prefill_s"] += self.profile.prefill_time(new, new * (cached + new / 2), 1)
        seq = SimSeq(rid, kind, req.prompt_tokens, cached, 1 if prefill_only else req.output_tokens,
                     prefill_only, cached)
        if cached:  # the prefix's blocks are read from the store first
            read = w.profile.transfer_time(self.config.kv_path, self._kv_bytes(cached))[1]
            w.held += 1
            self._push(t + read, JOIN, w, seq)
        else:
            w.add(seq)
            self._cut(w, t)

    def _kv_bytes(self, tokens: int) -> int:
        return -(-tokens // self.bs) * self.block_bytes

    # --------------------------------------------------------------------------------- events

    def _plan(self, w: SimEngine, t: float) -> None:
        factors = (1.0, 1.0)
        host = self.host
        if host is not None and w.num_requests:  # its threads: its share, and the idle engines' it may borrow
            idle = sum(not (e.busy or e.num_requests) for e in self.prefill_pool + self.decode_pool if e is not w)
            w.threads = host.step_threads(w.role, w.num_requests, w.prefilling(), idle)
            factors = host.factors(w.role, w.num_requests, host.allocate(self._holding() | {w: w.threads})[w],
                                   w.wide_ratio())
        end = w.plan(t, factors)
        if end is not None:
            self._push(end, STEP, w, w.version)

    def _holding(self) -> dict[SimEngine, int]:
        """The engines holding sequences, and the threads of each one's step (its share between steps)."""
        share = self.host.share
        return {w: w.threads if w.busy else share for w in self.prefill_pool + self.decode_pool
                if w.busy or w.num_requests}

    def _share_cores(self, t: float) -> None:
        """Engines began or ceased to hold sequences, or a step began on other threads: the cores are
        divided anew, and the steps in flight go on at their new pace (a decode span is cut at its
        next step, and planned again there)."""
        host = self.host
        holding = self._holding()
        if holding == host.holding:
            return
        host.holding = holding
        cores = host.allocate(holding)
        for w in holding:
            if not w.busy:
                continue
            factors = host.factors(w.role, w.num_requests, cores[w], w.wide_ratio())
            if w.span is not None:
                if factors[1] != w.span.slow:
                    self._cut(w, t)
            else:
                end = w.retime(t, factors)
                if end is not None:
                    self._push(end, STEP, w, w.version)

    def _cut(self, w: SimEngine, t: float) -> None:
        """Something changed for `w`'s span in flight (a sequence joins, its cores are lent or
        taken back): end it at the next step boundary (taking its blocks), where it is planned anew."""
        if w.busy:
            end = w.cut_span(t)
            if end is not None:
                self._push(end, STEP, w, w.version)

    def _on_join(self, w: SimEngine, seq: SimSeq, t: float) -> None:
        w.held -= 1
        self._cut(w, t)  # it joins at the next step boundary
        if seq.prefill_only or w.role == "colocated" or seq.computed == seq.cached and seq.cached:
            ok = w.import_seq(seq) if seq.computed else (w.add(seq) or True)
            if not ok:  # the cached prefix does not fit here now: compute the whole prompt
                seq.computed = seq.cached = 0
                w.add(seq)
        elif not w.import_seq(seq):  # no room beside its running requests: it waits for them to free some
            if w.blocks_for(seq.computed) > w.total_blocks:
                raise RuntimeError(f"request {seq.rid} needs {w.blocks_for(seq.computed)} KV blocks; a decode "
                                   f"worker has {w.total_blocks}")
            self.kv_stats["waited"] += 1
            w.waiting_jobs.append(seq)
            w.held += 1
        if not w.busy:
            self._plan(w, t)
        if not w.held:
            self._pull(w, t)

    def _on_step(self, w: SimEngine, t: float) -> None:
        for seq in w.complete(t, self.rec):
            if seq.prefill_only:
                self._prefill_done(w, seq, t)
            else:
                self._finished(seq.rid, t)
        if w.held:
            self._unblock(w, t)
        if self.waiting and w.role == "decode":
            self._offer_waiting(w, t)
        self._pull(w, t)
        if not w.busy:
            self._plan(w, t)

    def _prefill_done(self, w: SimEngine, seq: SimSeq, t: float) -> None:
        req = self.reqs[seq.rid]
        if self.cache is not None and req.prefix_keys:
            self.cache.insert(req)
        if req.output_tokens == 1:
            self._finished(seq.rid, t)
            return
        nbytes = self._kv_bytes(req.prompt_tokens) - self._kv_bytes(seq.cached)
        write = w.profile.transfer_time(self.config.kv_path, nbytes)[0]
        w.held += 1
        ks = self.kv_stats
        ks["transfers"] += 1
        ks["bytes"] += self._kv_bytes(req.prompt_tokens)
        ks["write_s"] += write
        self._push(t + write + self.profile.handoff_time(nbytes // self.block_bytes), KV_STORED, w, seq.rid)

    def _on_kv_stored(self, w: SimEngine, rid: int, t: float) -> None:
        w.held -= 1
        self.decode_q.append(rid)
        self._feed(self.decode_q, self.hungry_decode, t)
        self._pull(w, t)

    # -------------------------------------------------------------------------------- scaling

    def _tick(self, t: float) -> None:
        waiting = (len(self.prefill_q), len(self.decode_q) + len(self.direct_q))
        if self.config.mode == "colocated":
            waiting = (0, waiting[0] + waiting[1])
        prefill, decode = self.scaler.targets(t, self.arrived, waiting, self.work_done())
        changed = self.config.mode != "colocated" and self._scale("prefill", max(1, prefill), t)
        if self._scale("decode", max(1, decode), t) or changed:
            self.scale_log.append((t, self._count("prefill"), self._count("decode")))
        if self.heap:  # anything else still to happen: decide again later (else the run is over)
            self._push(t + self.scaler.interval_s, TICK, None)

    def work_done(self) -> Load:
        """The work done so far, as a gateway's counters total it: the engine time of the prefill
        workers' steps is all charged to prompts (as the real engines charge theirs)."""
        steps = sum(w.busy_s for w in self.prefill_pool + self.retired if w.role == "prefill")
        return Load(**(self.load | {"prefill_s": self.load["prefill_s"] + steps}))

    def _scale(self, kind: str, target: int, t: float) -> bool:
        """Add or drain workers of `kind` towards `target`; whether anything changed."""
        pool = self._pool(kind)
        starting = self.starting[kind]
        serving = [w for w in pool if not w.draining]
        have = len(serving) + len(starting)
        if target == have:
            return False
        if target > have:
            for _ in range(target - have):
                w = self._new_worker(kind, t)
                starting.append(w)
                self._push(t + self.scaler.startup_s, READY, w, kind)
        else:
            excess = have - target
            while excess and starting:  # those still loading go first: nothing to drain
                w = starting.pop()
                w.draining = True
                w.retired_s = t
                self.retired.append(w)
                excess -= 1
            # the least loaded (a job waiting unread goes back to the queue, so it is no load to finish)
            for w in sorted(serving, key=lambda w: w.num_requests + w.held - len(w.unread))[:excess]:
                w.draining = True
                self._put_back_unread(w, t)
                self._retire_if_done(w, t)
        return True

    def _pool(self, kind: str) -> list[SimEngine]:
        """The serving workers of `kind` ("prefill" | "decode": colocated engine workers are decode)."""
        return self.prefill_pool if kind == "prefill" else self.decode_pool

    def _count(self, kind: str) -> int:
        return sum(not w.draining for w in self._pool(kind)) + len(self.starting[kind])

    def _ready(self, w: SimEngine, kind: str, t: float) -> None:
        if w.draining:  # removed while it was still loading
            return
        self.starting[kind].remove(w)
        self._pool(kind).append(w)
        self._engines_changed()
        self._pull(w, t)
        if self.waiting and w.role == "decode":
            self._offer_waiting(w, t)

    def _retire_if_done(self, w: SimEngine, t: float) -> None:
        if w.draining and not w.busy and not w.num_requests and not w.held and w.retired_s is None:
            w.retired_s = t
            self._pool("prefill" if w.role == "prefill" else "decode").remove(w)
            self.retired.append(w)
            self._engines_changed()

    def _engines_changed(self) -> None:
        """A worker joined or left: the prefix cache's capacity, and the host's shares of its cores."""
        if self.cache is not None:
            self.cache.resize(self._cache_capacity())
        if self.host is not None:
            self.host.engines(len(self.prefill_pool) + len(self.decode_pool))

    def _finished(self, rid: int, t: float) -> None:
        self.rec.finish(rid, t)
        req, load = self.reqs[rid], self.load
        load["finished"] += 1
        load["output_tokens"] += req.output_tokens
        if self.closed is not None and rid in self.closed_ids:
            self._closed_next(t + self.profile.request_overhead_s)

    # ---------------------------------------------------------------------------- invariants

    def check_invariants(self, final: bool = False) -> None:
        for w in self.prefill_pool + self.decode_pool + self.retired:
            held = sum(s.blocks for s in w.running) + sum(s.blocks for s in w.waiting)
            if held != w.used_blocks or not 0 <= w.used_blocks <= w.total_blocks:
                raise AssertionError(f"worker {w.wid}: {w.used_blocks} blocks in use, sequences hold {held}, "
                                     f"budget {w.total_blocks}")
            if final and (w.used_blocks or w.running or w.waiting or w.held):
                raise AssertionError(f"worker {w.wid} still holds work at the end")
            if w.retired_s is not None and (w.num_requests or w.held or w.busy):
                raise AssertionError(f"worker {w.wid} left with work unfinished")
        if final:
            rec = self.rec
            for rid in range(len(rec.arrival)):
                if rec.finish_s[rid] < 0:
                    raise AssertionError(f"request {rid} never finished")
                if rec.tokens[rid] != rec.output[rid]:
                    raise AssertionError(f"request {rid}: {rec.tokens[rid]} tokens out, {rec.output[rid]} asked")
                if not rec.arrival[rid] <= rec.first_s[rid] <= rec.finish_s[rid]:
                    raise AssertionError(f"request {rid}: times out of order")

    # -------------------------------------------------------------------------------- report

    def report(self, slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None,
               since_s: float = 0.0) -> dict[str, Any]:
        """`since_s`: the requests that arrived from then on, and the workers' time from then on (the
        run before it a warm-up: a resized fleet that has seen a day's load before the day measured)."""
        rec = self.rec
        end = max(rec.finish_s, default=0.0)
        span = end - since_s
        summary = rec.summarize(span, self.profile.request_overhead_s, slo_ttft_ms, slo_tpot_ms, since_s)
        everyone = self.prefill_pool + self.decode_pool + self.retired
        by_role = {role: [w for w in everyone if w.role == role] for role in ("prefill", "decode", "colocated")}

        def gone(w) -> float:  # when a worker left (or the run ended)
            return end if w.retired_s is None else w.retired_s

        cost = {}
        for name, pool in by_role.items():
            if not pool:
                continue
            busy = sum(w.busy_s for w in pool)
            alive_s = sum(max(0.0, gone(w) - max(w.born_s, since_s)) for w in pool)
            lived = sum(gone(w) - w.born_s for w in pool)  # the whole run
            cost[name] = {"workers": alive_s / span if span > 0 else float(len(pool)),
                          "max_workers": self._peak(name),
                          "busy_s": busy, "gpu_s": alive_s * pool[0].profile.limits.gpus_per_worker,
                          "utilization": busy / lived if lived > 0 else 0.0,  # (over the whole run)
                          "preemptions": sum(w.preemptions for w in pool),
                          "max_kv_blocks_used": max(w.max_used_blocks for w in pool),
                          "kv_blocks_budget": pool[0].total_blocks}
        cost["kv_transfer"] = dict(self.kv_stats)
        if self.cache is not None:
            cost["prefix_cache"] = {"queried_tokens": self.cache.queried_tokens, "hit_tokens": self.cache.hit_tokens}
        summary["cost"] = cost
        # workers over time: the mean of a fleet that changed size, the count of one that did not
        n = sum(c["workers"] for k, c in cost.items() if k in by_role)
        gpus = sum(c["gpu_s"] for k, c in cost.items() if k in by_role) / span if span > 0 else \
            sum(len(pool) * pool[0].profile.limits.gpus_per_worker for pool in by_role.values() if pool)
        good = summary["goodput"]
        summary["per_gpu"] = {"workers": n, "gpus": gpus, "request_throughput": summary["request_throughput"] / gpus,
                              "request_goodput": good["request_goodput"] / gpus if good else None}
        if self.scaler is not None:
            summary["scaling"] = {"changes": len(self.scale_log), "log": [list(x) for x in self.scale_log]}
            if slo_ttft_ms is not None and slo_tpot_ms is not None:  # where in the run the SLOs were missed
                summary["scaling"]["slo_by_window"] = rec.by_window(SLO_WINDOW_S, self.profile.request_overhead_s,
                                                                    slo_ttft_ms, slo_tpot_ms)
        return summary

    def _peak(self, role: str) -> int:
        """The most workers of a role alive at once (loading ones included)."""
        pool = [w for w in self.prefill_pool + self.decode_pool + self.retired + sum(self.starting.values(), [])
                if w.role == role]
        edges = sorted([(w.born_s, 1) for w in pool] + [(w.retired_s, -1) for w in pool if w.retired_s is not None],
                       key=lambda e: (e[0], e[1]))
        peak = alive = 0
        for _, d in edges:
            alive += d
            peak = max(peak, alive)
        return peak


def simulate(profile: Profile, config: ClusterConfig, arrivals: Iterable[SimRequest], *,
             closed: ClosedLoop | None = None, itl_from_s: float | None = None, slo_ttft_ms: float | None = None,
             slo_tpot_ms: float | None = None, check: bool = False, scaler: Scaler | None = None,
             prefill_profile: Profile | None = None, measure_from_s: float = 0.0) -> dict[str, Any]:
    """Run to the end; the summary (bench's shape) plus cost per phase and the simulator's own speed.
    `scaler`: the pools change size as it decides (else they keep the config's counts).
    `prefill_profile`: the prefill pool's own (else `profile`'s).
    `measure_from_s`: the summary and the cost of the requests that arrived from then on and of the
    workers' time from then on (and ITL from then on, unless `itl_from_s` says); before it a warm-up."""
    t0 = time.perf_counter()
    if itl_from_s is None and measure_from_s:
        itl_from_s = measure_from_s
    cluster = Cluster(profile, config, itl_from_s=itl_from_s, scaler=scaler, prefill_profile=prefill_profile)
    cluster.run(arrivals, closed, check_every=97 if check else 0)
    cluster.check_invariants(final=True)
    summary = cluster.report(slo_ttft_ms, slo_tpot_ms, measure_from_s)
    wall = time.perf_counter() - t0
    summary["sim"] = {"events": cluster.events, "wall_s": wall, "requests_per_wall_s": summary["sent"] / max(wall, 1e-9),
                      "mode": config.mode, "prefill": config.prefill if config.mode != "colocated" else 0,
                      "decode": config.decode,
                      "load": cluster.work_done().__dict__}
    return summary
