"""`pdserve plan`: the cheapest configuration that meets the SLOs, found by simulation.

Inputs: a workload (a bench workload at a rate, or a trace), SLOs on TTFT p90 and ITL p90, and a
budget: workers (`--budget`), GPUs (`--budget-gpus`: each pool's workers counted at their profile's
GPUs, an answer over it rejected however few workers it has), or both. The search uses the split
the architecture is for — TTFT is mostly the prefill pool's doing, ITL the decode pool's — so each
pool is sized on its own first:

    1. P_min: the fewest prefill workers meeting the TTFT SLO with a generous decode pool
    2. D_min: the fewest decode workers meeting the ITL SLO with a generous prefill pool
    3. (P_min, D_min) together; while an SLO is missed, grow the pool that misses it
    4. colocated (and conditional, if asked): the fewest workers meeting both, per chunk budget

Each pool may also be tried on other profiles of the same model (`--prefill-profile`,
`--decode-profile`: another tensor-parallel group, say); each pairing is a search of its own, and
configurations are ranked by GPUs.

Each count is found by bisection (the SLO metrics fall as a pool grows), bracketed by steps that
double away from where the profile sizer (forecast.ProfileSizer: queueing models of the two pools,
on the mix measured in one roomy simulation) puts it — when it is right, two or three simulations
a pool. Every configuration tried is kept, and the answer lists the cheapest feasible ones with the
reason each other one failed.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import sys
from collections.abc import Callable, Mapping
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

from services.planner.forecast import Capacity, ProfileSizer
from shared.sim.cluster import ClusterConfig, simulate
from shared.sim.cost import Profile, load_profile
from shared.sim.workload import Load, Mix

log = logging.getLogger("pdserve.plan")
_forked: Callable[[Any], Any] | None = None  # what fork_map's worker processes call


def _call_forked(x: Any) -> Any:
    assert _forked is not None
    return _forked(x)


def fork_map(fn: Callable[[Any], Any], items, jobs: int) -> list:
    """[fn(x) for x in items], in up to `jobs` forked processes at once: each inherits this process
    (`fn` may be a bound method or closure: nothing but the items and results is pickled)."""
    global _forked
    items = list(items)
    jobs = max(1, min(jobs, len(items)))
    if jobs == 1:
        return [fn(x) for x in items]
    _forked = fn
    try:
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
            return list(pool.map(_call_forked, items))
    finally:
        _forked = None


@dataclass(frozen=True)
class PlanSpec:
    slo_ttft_p90_ms: float
    slo_itl_p90_ms: float
    budget: int  # workers at most (a worker is the profile's gpus_per_worker GPUs; answers are ranked by GPUs)
    modes: tuple[str, ...] = ("disaggregated", "colocated")
    chunk_budgets: tuple[int | None, ...] = (None,)  # None: the profile's
    kv_path: str = "shm"
    # None: the SLOs are on the p90s (the form). A percentage: instead, at least this share of
    # requests must meet TTFT, and of TPOT (each request's mean ITL), and both together
    attainment_pct: float | None = None
    # jobs a prefill worker takes at once (`pdserve up --max-inflight`), None: the profile's. A worker
    # with room pulls the next job even while busy, so a deep one queues jobs behind its own long
    # prompts while another worker frees up; a shallow one leaves them in the shared queue
    prefill_inflights: tuple[int | None, ...] = (None,)
    # GPUs at most, where a worker of each pool may span another number of them (tensor parallel): an
    # answer over it is rejected, however few workers it has. None: only the workers' budget
    gpu_budget: float | None = None

    def __post_init__(self) -> None:
        if self.slo_ttft_p90_ms <= 0 or self.slo_itl_p90_ms <= 0:
            raise ValueError("SLOs must be positive")
        if self.attainment_pct is not None and not 0 < self.attainment_pct <= 100:
            raise ValueError("the SLO attainment is a percentage of requests: above 0, at most 100")
        if self.budget < 1 or (self.budget < 2 and "disaggregated" in self.modes and len(self.modes) == 1):
            raise ValueError("the budget must allow at least one worker per pool")
        if self.gpu_budget is not None and not self.gpu_budget > 0:
            raise ValueError("the GPU budget must be positive")

    def within(self, gpus: float) -> bool:
        return self.gpu_budget is None or gpus <= self.gpu_budget + 1e-9


@dataclass
class Trial:
    config: ClusterConfig
    ttft_p90_ms: float
    itl_p90_ms: float
    goodput: float | None
    summary: dict[str, Any] = field(repr=False)
    ttft_ok: bool = False
    itl_ok: bool = False
    both_ok: bool = False

    prefill_profile: str | None = None  # the prefill pool's own profile (by name), None: the main one
    tpot_p90_ms: float = 0.0
    decode_profile: str | None = None  # the decode pool's, likewise

    @property
    def workers(self) -> int:
        return self.config.num_workers

    @property
    def gpus(self) -> float:
        return self.summary["per_gpu"]["gpus"]

    def meets(self, spec: PlanSpec) -> bool:
        return self.ttft_ok and self.itl_ok and self.both_ok

    def why_not(self, spec: PlanSpec) -> str:
        reasons = []
        att = self.summary.get("slo_attainment") or {}
        if not self.ttft_ok:
            reasons.append(f"TTFT p90 {self.ttft_p90_ms:.0f} ms > {spec.slo_ttft_p90_ms:g}" if spec.attainment_pct is None
                           else f"TTFT met by {att.get('ttft_pct', 0):.1f}% < {spec.attainment_pct:g}%")
        if not self.itl_ok and spec.attainment_pct is None:
            reasons.append(f"ITL p90 {self.itl_p90_ms:.1f} ms > {spec.slo_itl_p90_ms:g}" if self.itl_p90_ms >
                           spec.slo_itl_p90_ms else f"TPOT p90 {self.tpot_p90_ms:.1f} ms > {spec.slo_itl_p90_ms:g} "
                           "(streams wait for a decode slot)")
        elif not self.itl_ok:
            reasons.append(f"TPOT met by {att.get('tpot_pct', 0):.1f}% < {spec.attainment_pct:g}%")
        if self.ttft_ok and self.itl_ok and not self.both_ok:
            reasons.append(f"both met by {self.summary['goodput']['attainment_pct']:.1f}% < {spec.attainment_pct:g}%")
        if self.workers > spec.budget:
            reasons.append(f"{self.workers} workers > budget {spec.budget}")
        if not spec.within(self.gpus):
            reasons.append(f"{self.gpus:g} GPUs > GPU budget {spec.gpu_budget:g}")
        return "; ".join(reasons) or "meets the SLOs"

    def to_json(self) -> dict[str, Any]:
        c = self.config
        return {"mode": c.mode, "prefill": c.prefill if c.mode != "colocated" else 0, "decode": c.decode,
                "prefill_profile": self.prefill_profile, "decode_profile": self.decode_profile,
                "prefill_inflight": c.prefill_max_inflight,
                "workers": self.workers, "gpus": self.gpus, "chunk_budget": c.max_num_batched_tokens,
                "ttft_p90_ms": self.ttft_p90_ms, "tpot_p90_ms": self.tpot_p90_ms,
                "itl_p90_ms": self.itl_p90_ms, "request_goodput": self.goodput,
                "request_throughput": self.summary["request_throughput"]}


def pool_profiles(main: Profile, prefill: Profile | None = None,
                  decode: Profile | None = None) -> tuple[Profile, Profile | None]:
    """`simulate`'s profile and prefill_profile for pools on `prefill` and `decode` (None: `main`): its
    main profile is the decode pool's (and colocated workers'); the prefill pool's is given apart."""
    return (main if decode is None else decode), (prefill if prefill is not None else
                                                  main if decode is not None else None)


class Planner:
    """Runs and remembers simulations of one workload (`arrivals()` gives a fresh request list).
    `prefill_profiles`, `decode_profiles`: other profiles that pool may run on, by name (the same
    model's KV); None in a pairing below is the main profile (`profile`), which colocated runs on."""

    def __init__(self, profile: Profile, spec: PlanSpec, arrivals: Callable[[], list], slo_tpot_ms: float | None = None,
                 prefill_profiles: Mapping[str, Profile] | None = None,
                 decode_profiles: Mapping[str, Profile] | None = None,
                 pairings: list[tuple[str | None, str | None]] | None = None):
        self.profile, self.spec, self.arrivals = profile, spec, arrivals
        self.only_pairings = pairings  # None: every pairing of the pools' profiles
        self.prefill_profiles = dict(prefill_profiles or {})
        self.decode_profiles = dict(decode_profiles or {})
        self.slo_tpot_ms = slo_tpot_ms if slo_tpot_ms is not None else spec.slo_itl_p90_ms
        self.trials: dict[tuple[ClusterConfig, str | None, str | None], Trial] = {}
        # what the profile sizer said, where each search started: by (prefill profile, decode profile, jobs at once)
        self.sized: dict[tuple[str | None, str | None, int | None], dict[str, Any]] = {}
        self._jobs_within = 1  # processes one search may use (plan(): when it is the only one)

    def pairings(self) -> list[tuple[str | None, str | None]]:
        """(prefill profile, decode profile) of each disaggregated search, by name (None: the main one)."""
        if self.only_pairings is not None:
            return list(self.only_pairings)
        return [(pp, dp) for pp in (None, *self.prefill_profiles) for dp in (None, *self.decode_profiles)]

    def trial(self, config: ClusterConfig, prefill_profile: str | None = None,
              decode_profile: str | None = None) -> Trial:
        key = (config, prefill_profile, decode_profile)
        if key not in self.trials:
            main, prefill = pool_profiles(self.profile, self.prefill_profiles.get(prefill_profile),
                                          self.decode_profiles.get(decode_profile))
            s = simulate(main, config, self.arrivals(), slo_ttft_ms=self.spec.slo_ttft_p90_ms,
                         slo_tpot_ms=self.slo_tpot_ms, prefill_profile=prefill)
            ttft = s["ttft_ms"]["p90"] if s["ttft_ms"] else float("inf")
            itl = s["itl_ms"]["p90"] if s["itl_ms"] else 0.0
            spec = self.spec
            # a stream's mean gap (TPOT) as well: ITL's p90 over all gaps misses a wait for a decode
            # slot, one gap a stream, however long
            tpot = s["tpot_ms"]["p90"] if s.get("tpot_ms") else 0.0
            if spec.attainment_pct is None:
                ok = (ttft <= spec.slo_ttft_p90_ms, itl <= spec.slo_itl_p90_ms and tpot <= spec.slo_itl_p90_ms)
                ok += (ok[0] and ok[1],)
            else:
                att, a = s["slo_attainment"], spec.attainment_pct
                ok = (att["ttft_pct"] >= a, att["tpot_pct"] >= a, s["goodput"]["attainment_pct"] >= a)
            self.trials[key] = Trial(config, ttft, itl, s["goodput"]["request_goodput"], s, *ok,
                                     prefill_profile=prefill_profile, tpot_p90_ms=tpot, decode_profile=decode_profile)
            log.info("%s P%d%s D%d%s chunk %s inflight %s: TTFT p90 %.0f ms, ITL p90 %.1f ms", config.mode,
                     config.prefill, f" ({prefill_profile})" if prefill_profile else "", config.decode,
                     f" ({decode_profile})" if decode_profile else "", config.max_num_batched_tokens,
                     config.prefill_max_inflight, ttft, itl)
        return self.trials[key]

    def smallest(self, make: Callable[[int], ClusterConfig], ok: Callable[[Trial], bool], hi: int,
                 guess: int | None = None, prefill_profile: str | None = None,
                 decode_profile: str | None = None) -> int | None:
        """The least n in [1, hi] with ok(trial(make(n))), assuming ok is monotone in n: from 1 by
        doubling, or from `guess` by steps that double away from it (a good guess: two or three
        simulations), then bisection."""
        def trial(c: ClusterConfig) -> Trial:
            return self.trial(c, prefill_profile, decode_profile)

        if guess is None:
            lo, n = 0, 1
        else:
            n = min(max(1, guess), hi)
            step = 1
            if ok(trial(make(n))):  # down until it fails
                lo = n - step
                while lo >= 1 and ok(trial(make(lo))):
                    n, step = lo, 2 * step
                    lo = n - step
                lo = max(lo, 0)
            else:  # up until it holds
                lo = n
                n = min(hi, n + step)
                while not ok(trial(make(n))):
                    if n >= hi:
                        return None
                    lo, step = n, 2 * step
                    n = min(hi, n + step)
        while guess is None and not ok(trial(make(n))):
            if n >= hi:
                return None
            lo, n = n, min(hi, 2 * n)
        # ok(n), not ok(lo) (or lo = 0)
        while n - lo > 1:
            mid = (lo + n) // 2
            if ok(trial(make(mid))):
                n = mid
            else:
                lo = mid
        return n

    def plan_disaggregated(self, chunk: int | None, prefill_profile: str | None = None,
                           inflight: int | None = None, decode_profile: str | None = None) -> Trial | None:
        spec, pools = self.spec, (prefill_profile, decode_profile)
        base = ClusterConfig(mode="disaggregated", kv_path=spec.kv_path, max_num_batched_tokens=chunk,
                             prefill_max_inflight=inflight)
        big = max(1, spec.budget - 1)
        guess = self.guess(replace(base, prefill=big, decode=big), *pools)

        def pool(i: int) -> int | None:  # each pool's size on its own, the other one roomy
            make = (lambda n: replace(base, prefill=n, decode=big)) if i == 0 else \
                (lambda n: replace(base, prefill=big, decode=n))
            return self.smallest(make, (lambda t: t.ttft_ok) if i == 0 else (lambda t: t.itl_ok), big, guess[i],
                                 *pools)

        # the plan's only search (_jobs_within > 1): the two pools' bisections at once
        p, d = self.at_once([partial(pool, 0), partial(pool, 1)], self._jobs_within)
        if p is None or d is None:
            return None
        while p + d <= spec.budget:
            t = self.trial(replace(base, prefill=p, decode=d), *pools)
            if t.meets(spec):
                return t
            if not t.ttft_ok or t.itl_ok:  # (both met separately, not together: grow prefill first)
                p += max(1, p // 20)
            if not t.itl_ok:
                d += max(1, d // 20)
        return None

    def guess(self, roomy: ClusterConfig, prefill_profile: str | None = None,
              decode_profile: str | None = None) -> tuple[int | None, int | None]:
        """Where to start looking: what the profile sizer (forecast.ProfileSizer) says each pool needs
        for this load's rate and mix, the mix measured on `roomy` (pools too big to queue; the prefill
        seconds a request, so, on the prefill pool's own profile; decode by the decode pool's)."""
        reqs = self.arrivals()
        span = max(r.arrival_s for r in reqs) - min(r.arrival_s for r in reqs)
        probe = replace(roomy, shared_cores=False)  # the work itself, not slowed by engines sharing a CPU host's cores
        mix = Mix.of(Load(**self.trial(probe, prefill_profile, decode_profile).summary["sim"]["load"]))
        if mix is None or span <= 0:
            return None, None
        decode = self.decode_profiles[decode_profile] if decode_profile else self.profile
        spec, tau = self.spec, decode.tokens_per_event
        pct = spec.attainment_pct / 100 if spec.attainment_pct is not None else 0.9
        sizer = ProfileSizer(decode, spec.slo_ttft_p90_ms / 1e3,
                             min(self.slo_tpot_ms, spec.slo_itl_p90_ms / tau) / 1e3, pct, spec.kv_path)
        rate = len(reqs) / span
        p, d = sizer.workers(0, rate, mix), sizer.workers(1, rate, mix)
        self.sized[prefill_profile, decode_profile, roomy.prefill_max_inflight] = {
            "prefill": p, "decode": d, "rate": rate, "mix": mix.__dict__}
        return p, d

    def plan_single_pool(self, mode: str, chunk: int | None) -> Trial | None:
        base = ClusterConfig(mode=mode, kv_path=self.spec.kv_path, max_num_batched_tokens=chunk)
        if mode == "conditional":  # a prefill pool of the disaggregated plan's size, decode grows
            n = self.smallest(lambda k: replace(base, prefill=max(1, k // 3), decode=max(1, k - k // 3)),
                              lambda t: t.meets(self.spec), self.spec.budget)
            return None if n is None else self.trial(replace(base, prefill=max(1, n // 3), decode=max(1, n - n // 3)))
        n = self.smallest(lambda k: replace(base, decode=k), lambda t: t.meets(self.spec), self.spec.budget)
        return None if n is None else self.trial(replace(base, decode=n))

    def searches(self) -> list[tuple[str, tuple]]:
        """The independent searches of a plan, as (method, its arguments): per chunk budget, each
        disaggregated pairing and prefill depth, and each other mode."""
        out: list[tuple[str, tuple]] = []
        for chunk in self.spec.chunk_budgets:
            for mode in self.spec.modes:
                if mode == "disaggregated":
                    out += [("plan_disaggregated", (chunk, pp, inflight, dp)) for pp, dp in self.pairings()
                            for inflight in self.spec.prefill_inflights]
                else:
                    out.append(("plan_single_pool", (mode, chunk)))
        return out

    def at_once(self, searches: list[Callable[[], Any]], jobs: int) -> list:
        """[search() for search in searches], `jobs` at once in forked processes (fork_map). The
        trials each one ran, and what the profile sizer said where it began, are kept here in the
        order one process would have run them in."""
        def run(i: int) -> tuple[Any, dict, dict]:  # (an index: a search holds the planner, never pickled)
            return searches[i](), self.trials, self.sized

        out = []
        for result, trials, sized in fork_map(run, range(len(searches)), jobs):
            for key, t in trials.items():
                self.trials.setdefault(key, t)
            self.sized.update(sized)
            out.append(result)
        return out

    def plan(self, jobs: int = 1) -> dict[str, Any]:
        """The cheapest configuration found, its runner-ups and the rejected ones. `jobs` > 1: the
        searches run in that many processes at once (fork_map), their trials merged in the searches'
        order — the answer is the one a single process gives. A plan of one disaggregated search
        bisects its two pools at once instead."""
        searches = self.searches()
        if jobs > 1 and len(searches) > 1:
            found = self.at_once([partial(getattr(self, method), *args) for method, args in searches], jobs)
        else:
            self._jobs_within = jobs  # one search (or one process): it may split its pools
            try:
                found = [getattr(self, method)(*args) for method, args in searches]
            finally:
                self._jobs_within = 1
        best: list[Trial] = [t for t in found if t is not None and self.spec.within(t.gpus)]
        best.sort(key=lambda t: (t.gpus, -(t.goodput or 0)))
        feasible_ids = {id(t) for t in best}
        tried = sorted((t for t in self.trials.values() if t.config.shared_cores), key=lambda t: t.gpus)
        rejected = [t.to_json() | {"why_not": t.why_not(self.spec)} for t in tried
                    if id(t) not in feasible_ids and not (t.meets(self.spec) and self.spec.within(t.gpus))]
        return {"slo": {"ttft_p90_ms": self.spec.slo_ttft_p90_ms, "itl_p90_ms": self.spec.slo_itl_p90_ms},
                "budget": self.spec.budget, "gpu_budget": self.spec.gpu_budget,
                "recommended": best[0].to_json() if best else None,
                "runner_ups": [t.to_json() | {"why": f"{t.gpus - best[0].gpus:g} more GPUs"} for t in best[1:]],
                "rejected": rejected[:20], "simulations": len(self.trials),
                "profile_sizer": self.sized.get((best[0].prefill_profile, best[0].decode_profile,
                                                 best[0].config.prefill_max_inflight)) if best else None}


def add_plan_args(p: argparse.ArgumentParser) -> None:
    from services.planner.simulate import add_acceptance_args, add_workload_args

    add_workload_args(p)
    p.add_argument("--profile", default=None)
    add_acceptance_args(p)
    p.add_argument("--prefill-profile", action="append", default=[], metavar="FILE",
                   help="another profile of the same model the prefill pool may run on (another tensor-parallel "
                        "group): each is searched too, and the configurations ranked by GPUs (repeatable)")
    p.add_argument("--decode-profile", action="append", default=[], metavar="FILE",
                   help="likewise for the decode pool (--profile is the one colocated workers run on); every "
                        "pairing with the prefill pool's profiles is searched (repeatable)")
    p.add_argument("--slo-ttft-p90-ms", type=float, required=True)
    p.add_argument("--slo-itl-p90-ms", type=float, required=True)
    p.add_argument("--budget", type=int, default=None,
                   help="workers at most (answers are ranked by GPUs; default: as many as --budget-gpus allows)")
    p.add_argument("--budget-gpus", type=float, default=None,
                   help="GPUs at most, each pool's workers counted at their profile's GPUs (TP4: 4); an answer "
                        "over it is rejected however few workers it has")
    p.add_argument("--modes", default="disaggregated,colocated", help="comma list of modes to consider")
    p.add_argument("--chunk-budgets", default="", help="comma list of max tokens per step (default: the profile's)")
    p.add_argument("--prefill-inflights", default="",
                   help="comma list of jobs a prefill worker takes at once (--max-inflight; default: the profile's)")
    p.add_argument("--kv-path", default="shm", choices=["shm", "network"])
    p.add_argument("--slo-attainment", type=float, default=None, metavar="PCT",
                   help="the SLOs' other form: at least PCT%% of requests within the TTFT SLO, within the TPOT one "
                        "(--slo-tpot-ms, else the ITL one) and within both (default: the p90s)")
    p.add_argument("--json", default=None, help="write the plan here ('-': stdout)")
    p.add_argument("--jobs", type=positive_int, default=len(os.sched_getaffinity(0)), metavar="N",
                   help="searches run at once, each in a process of its own: each mode, pairing of profiles, "
                        "chunk budget and prefill depth is one (default: the cores this process may use)")
    p.add_argument("--kustomize", default=None, metavar="DIR",
                   help="also write a kustomize overlay deploying the recommended configuration on Kubernetes "
                        "(kubectl apply -k DIR): pools, chunk budget, mode and `pdserve planner`'s flags")
    p.add_argument("--kustomize-base", default=None, metavar="OVERLAY",
                   help="the overlay it is written over (default: deploy/k8s/overlays/production)")
    g = p.add_argument_group("a plan through a load forecast (services/planner/schedule.py)")
    g.add_argument("--forecast", default=None, metavar="CSV",
                   help="`time,rate` rows (seconds or HH:MM, req/s from then on): plan the busiest period, then "
                        "every other rate with its shape, and print the pools' schedule; the mix is --workload's "
                        "or --trace's, each rate searched on --duration seconds of it")
    g.add_argument("--timezone", default=None, metavar="ZONE",
                   help="--forecast in clock times: the IANA zone they are in (Europe/Berlin, UTC …), recorded in "
                        "the plan for whoever reads it back as a live schedule (default: that machine's local time)")
    g.add_argument("--startup-s", type=float, default=120.0,
                   help="--forecast: seconds from adding a worker until it serves (a pool grows this far ahead)")
    g.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True,
                   help="--forecast: simulate the whole forecast resized by the schedule, and report each period")
    g.add_argument("--repair", type=int, default=3,
                   help="--forecast: rounds of growing each period the verification finds missing an SLO (~5%% "
                        "more workers in the pool that sets it) and verifying again")


# What the simulator does not calibrate on a CPU host: its profile is fitted on a disaggregated stack.
# Replaying real runs of this 2-core host (BENCHMARKS.md, "Engines on one host's cores"): two colocated
# engines within 3-25%; one colocated engine under load 2-3x too slow (long-doc at 0.3 req/s, TTFT
# p50 11.6 s simulated, 3.9 s real), so a plan may ask for an engine more than it needs
COLOCATED_ON_CPU = ("the simulator's colocated mode is calibrated on a disaggregated stack: on a 2-core host two "
                    "colocated engines simulated within 25% of real runs, one engine at chat near its capacity "
                    "within 10% on TTFT and 10-50% slow on ITL and E2E (a plan may ask for one engine more than "
                    "needed): check this answer with pdserve bench")


def positive_int(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def add_caveat(result: dict[str, Any], lines: list[str], profile: Profile) -> None:
    """What a plan's answer needs said beside it, in its JSON and its lines: a colocated answer on a
    CPU profile (COLOCATED_ON_CPU)."""
    rec = result.get("recommended")
    if rec is not None and rec["mode"] == "colocated" and profile.meta.get("device") == "cpu":
        result["caveat"] = COLOCATED_ON_CPU
        lines.append(f"note: {COLOCATED_ON_CPU}")


def worker_budget(args: argparse.Namespace, profiles: list[Profile]) -> int:
    """`--budget`, else as many workers as `--budget-gpus` holds of the smallest of them."""
    if args.budget is not None:
        return args.budget
    if args.budget_gpus is None:
        raise ValueError("give a budget: --budget (workers) or --budget-gpus (GPUs)")
    return int(args.budget_gpus // min(p.limits.gpus_per_worker for p in profiles))


def cmd_plan(args: argparse.Namespace) -> int:
    from services.planner.simulate import request_list, workload_profile

    profile = workload_profile(args, load_profile(args.profile))
    prefill_profiles = {Path(f).stem: load_profile(f) for f in args.prefill_profile}
    decode_profiles = {Path(f).stem: load_profile(f) for f in args.decode_profile}
    chunks = tuple(int(x) for x in args.chunk_budgets.split(",") if x.strip()) or (None,)
    inflights = tuple(int(x) for x in args.prefill_inflights.split(",") if x.strip()) or (None,)
    budget = worker_budget(args, [profile, *prefill_profiles.values(), *decode_profiles.values()])
    spec = PlanSpec(args.slo_ttft_p90_ms, args.slo_itl_p90_ms, budget,
                    tuple(m.strip() for m in args.modes.split(",") if m.strip()), chunks, args.kv_path,
                    prefill_inflights=inflights, attainment_pct=args.slo_attainment, gpu_budget=args.budget_gpus)
    if args.forecast:
        from services.planner.schedule import cmd_plan_forecast

        if args.kustomize:
            raise ValueError("--kustomize writes a plan for one rate; a forecast's schedule goes to `pdserve planner "
                             "--schedule plan.json` (deploy/k8s/README.md)")

        return cmd_plan_forecast(args, profile, spec, prefill_profiles, decode_profiles)
    reqs = request_list(args)
    result = Planner(profile, spec, lambda: [replace(r) for r in reqs], args.slo_tpot_ms, prefill_profiles,
                     decode_profiles).plan(args.jobs)
    rec = result["recommended"]
    result["tokens_per_event"] = profile.tokens_per_event  # the acceptance its decode steps were timed at
    gpus = f" and {spec.gpu_budget:g} GPUs" if spec.gpu_budget is not None else ""
    lines = [f"pdserve plan: {len(reqs)} requests, SLOs {slo_text(spec, args.slo_tpot_ms)}, budget {spec.budget} "
             f"workers{gpus} ({result['simulations']} simulations, {profile.tokens_per_event:.2f} tokens an event)"]
    if rec is None:
        lines.append("no configuration within the budget meets the SLOs")
    else:
        lines.append(f"recommended: {_describe(rec)}")
        span = max(r.arrival_s for r in reqs) - min(r.arrival_s for r in reqs)
        # what one worker of each pool carries at the SLOs: this load ÷ its pool's size (a lower bound
        # for a pool the search could not make smaller, e.g. one worker)
        if rec["mode"] == "disaggregated" and span > 0:
            cap = Capacity.from_plan(len(reqs) / span, rec["prefill"], rec["decode"])
            result["capacity_rps_per_worker"] = {"prefill": cap.prefill_rps, "decode": cap.decode_rps}
            lines.append(f"  per worker at these SLOs: {cap.prefill_rps:.3g} req/s prefill, {cap.decode_rps:.3g} "
                         f"req/s decode (pdserve planner --policy forecast --capacity "
                         f"{cap.prefill_rps:.3g},{cap.decode_rps:.3g})")
        sized = result["profile_sizer"]
        if sized:
            m = sized["mix"]
            lines.append(f"  the profile sizer put it at {sized['prefill']} prefill + {sized['decode']} decode for "
                         f"{sized['rate']:.3g} req/s of {m['prefill_s']:.3g} s prefill, {m['prompt_tokens']:.0f} "
                         f"prompt and {m['output_tokens']:.0f} output tokens a request (the search began there)")
        lines += [f"  runner-up: {_describe(t)} ({t['why']})" for t in result["runner_ups"]]
    lines += [f"  rejected: {_describe(t)}: {t['why_not']}" for t in result["rejected"][:8]]
    add_caveat(result, lines, profile)
    if rec is not None:
        saved = f"   (or: pdserve up --plan {args.json})" if args.json and args.json != "-" else ""
        lines.append(f"run it: {up_command(rec)}{saved}")
        if args.kustomize:
            from services.planner import kustomize

            try:
                kustomize.write(result, Path(args.kustomize), Path(args.kustomize_base or kustomize.DEFAULT_BASE))
                lines.append(f"on Kubernetes: kubectl apply -k {args.kustomize}")
            except ValueError as exc:
                lines.append(f"on Kubernetes: not written ({exc})")
    emit(result, lines, args.json)
    return 0 if rec is not None else 1


def emit(result: dict[str, Any], lines: list[str], json_path: str | None) -> None:
    """The plan's lines to stdout and its JSON to `json_path`; with '-', the JSON to stdout and the
    lines to stderr."""
    if json_path == "-":
        print(json.dumps(result, indent=1))
        print("\n".join(lines), file=sys.stderr)
    else:
        print("\n".join(lines))
        if json_path:
            Path(json_path).write_text(json.dumps(result, indent=1) + "\n")


def slo_text(spec: PlanSpec, slo_tpot_ms: float | None = None) -> str:
    if spec.attainment_pct is None:
        return f"TTFT p90 <= {spec.slo_ttft_p90_ms:g} ms, ITL p90 <= {spec.slo_itl_p90_ms:g} ms"
    return (f"TTFT <= {spec.slo_ttft_p90_ms:g} ms and TPOT <= {slo_tpot_ms or spec.slo_itl_p90_ms:g} ms, each and "
            f"both for >= {spec.attainment_pct:g}% of requests")


def deployment(rec: dict[str, Any]) -> dict[str, Any]:
    """`pdserve up`'s settings for a plan's recommended configuration (its JSON's `recommended`): the
    mode, the pools, the chunk budget and the jobs a prefill worker takes. A pool planned on another
    profile than the main one (another tensor-parallel group) is not what `pdserve up` runs: ValueError."""
    for pool in ("prefill", "decode"):
        if rec.get(f"{pool}_profile"):
            raise ValueError(f"its {pool} pool was planned on {rec[f'{pool}_profile']}, not on the main profile: "
                             "`pdserve up` runs every worker as the main profile's engine")
    out: dict[str, Any] = {"mode": rec["mode"]}
    if rec["mode"] != "colocated":
        out["prefill"] = rec["prefill"]
    out["decode"] = rec["decode"]
    if rec.get("chunk_budget"):
        out["max_num_batched_tokens"] = rec["chunk_budget"]
    if rec.get("prefill_inflight") and rec["mode"] != "colocated":
        out["max_inflight"] = rec["prefill_inflight"]
    return out


def up_command(rec: dict[str, Any], extra: str = "") -> str:
    """The `pdserve up` command line that runs `rec` (or why it cannot)."""
    try:
        flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in deployment(rec).items())
    except ValueError as exc:
        return f"not with pdserve up: {exc}"
    return f"pdserve up {flags}{extra}"


def _describe(t: dict[str, Any]) -> str:
    on = f" ({t['prefill_profile']})" if t.get("prefill_profile") else ""
    on_d = f" ({t['decode_profile']})" if t.get("decode_profile") else ""
    pools = (f"{t['prefill']} prefill{on} + {t['decode']} decode{on_d}" if t["mode"] != "colocated"
             else f"{t['decode']} workers")
    chunk = f", chunk {t['chunk_budget']}" if t["chunk_budget"] else ""
    chunk += f", {t['prefill_inflight']} jobs a prefill worker" if t.get("prefill_inflight") else ""
    return (f"{t['mode']} {pools}{chunk}, {t['gpus']:g} GPUs: TTFT p90 {t['ttft_p90_ms']:.0f} ms, "
            f"ITL p90 {t['itl_p90_ms']:.1f} ms, {t['request_throughput']:.2f} req/s")
