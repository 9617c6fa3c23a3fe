"""The live planner's policy under a step change in load, driven by a simulated system (a fluid
queueing model of the two pools, with workers that take an interval to start and two to drain)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from services.planner.autoscale import (
    AutoscaleConfig, Autoscaler, LiveAutoscaler, MetricsWatcher, Observation, histogram_p90, parse_prometheus,
)
from shared.sim.workload import Load

PREFILL_RATE, DECODE_RATE = 1.0, 1.5  # requests/s one worker of each pool serves


class FakeCluster:
    """Actuator + system: spawned workers serve from the next interval on; drained ones finish
    their work for two intervals, then exit. Records every process's life for the assertions."""

    def __init__(self, interval_s: float):
        self.dt = interval_s
        self.t = 0
        self.alive: dict[str, dict] = {}
        self.log: list[tuple[int, str, str]] = []
        self.queue = {"prefill": 0.0, "decode": 0.0}
        self.max_processes = 0
        self.n = {"prefill": 0, "decode": 0}
        for kind in ("prefill", "decode"):
            self.spawn(kind)
        for p in self.alive.values():
            p["serving_from"] = 0

    # Actuator
    def spawn(self, kind: str) -> str:
        name = f"{kind}-{self.n[kind]}"
        self.n[kind] += 1
        self.alive[name] = {"kind": kind, "serving_from": self.t + 1, "drain_at": None}
        self.log.append((self.t, "spawn", name))
        self.max_processes = max(self.max_processes, len(self.alive))
        return name

    def drain(self, kind: str, name: str, load=None) -> None:
        assert self.alive[name]["drain_at"] is None
        self.alive[name]["drain_at"] = self.t
        self.log.append((self.t, "drain", name))

    def exited(self, name: str) -> bool:
        return name not in self.alive

    # the system
    def serving(self, kind: str) -> int:
        return sum(1 for p in self.alive.values()
                   if p["kind"] == kind and p["serving_from"] <= self.t and p["drain_at"] is None)

    def interval(self, rate: float) -> Observation:
        self.t += 1
        for name in [n for n, p in self.alive.items() if p["drain_at"] is not None and self.t - p["drain_at"] >= 2]:
            del self.alive[name]
            self.log.append((self.t, "exit", name))
        arrivals = rate * self.dt
        ttft = itl = None
        waiting = {}
        for kind, mu, base, slope in (("prefill", PREFILL_RATE, 0.3, 1.0), ("decode", DECODE_RATE, 0.05, 1.0)):
            cap = max(1, self.serving(kind)) * mu * self.dt
            q = self.queue[kind] + arrivals
            served = min(q, cap)
            self.queue[kind] = q - served
            rho = min(0.95, arrivals / cap) if cap else 0.95
            latency = base / (1 - rho) + (self.queue[kind] / cap) * self.dt * slope
            waiting[kind] = self.queue[kind]
            if kind == "prefill":
                ttft = latency if arrivals else None
            else:
                itl = latency if arrivals else None
        return Observation(requests=int(arrivals), ttft_p90_s=ttft, itl_p90_s=itl,
                           prefill_waiting=waiting["prefill"], decode_waiting=waiting["decode"])


CONFIG = AutoscaleConfig(min_prefill=1, max_prefill=6, min_decode=1, max_decode=4, budget=8, interval_s=5.0,
                         up_after=2, down_after=6, cooldown=2, slo_ttft_p90_s=2.0, slo_itl_p90_s=0.25)


def _drive(config, load):
    cluster = FakeCluster(config.interval_s)
    scaler = Autoscaler(config, cluster, {"prefill": ["prefill-0"], "decode": ["decode-0"]})
    history = []
    for rate in load:
        obs = cluster.interval(rate)
        scaler.step(obs)
        history.append((rate, scaler.count("prefill"), scaler.count("decode"), scaler.processes, obs))
        assert scaler.processes <= config.budget  # draining processes included
        assert len(cluster.alive) == scaler.processes
    return cluster, scaler, history


def test_step_up_steady_then_traffic_stops():
    load = [0.5] * 10 + [3.0] * 60 + [0.0] * 60
    cluster, scaler, history = _drive(CONFIG, load)
    adds = [d for d in scaler.decisions if d.action == "add"]
    # scales up within N intervals of the step (up_after hot intervals + one for the queue to show)
    assert adds and adds[0].interval <= 10 + CONFIG.up_after + 1
    # by the end of the high phase both SLOs are met with the pools it chose
    _, p, d, _, obs = history[69]
    assert obs.ttft_p90_s <= CONFIG.slo_ttft_p90_s and obs.itl_p90_s <= CONFIG.slo_itl_p90_s
    assert p * PREFILL_RATE >= 3.0 and d * DECODE_RATE >= 3.0
    # no oscillation under the constant load: the last 30 intervals of it change nothing
    assert not [d for d in scaler.decisions if 40 < d.interval <= 70]
    # traffic stops: down to the minimum, one drain at a time per pool
    assert history[-1][1:3] == (CONFIG.min_prefill, CONFIG.min_decode)
    assert scaler.processes == CONFIG.min_prefill + CONFIG.min_decode
    # never a flip back and forth: per pool, all adds come before all drains
    for kind in ("prefill", "decode"):
        actions = [d.action for d in scaler.decisions if d.kind == kind]
        assert actions == sorted(actions, key=lambda a: a == "drain"), actions


def test_streams_that_miss_the_slo_keep_their_pool_though_nothing_new_arrives():
    """Long streams, all begun before: intervals with no arrivals but ITL over the SLO are hot, never
    cold — the pool at its maximum keeps its workers (it once drained one under load: CI, stop 49)."""
    hands = SpawnOnly()
    scaler = Autoscaler(CONFIG, hands, {"prefill": ["prefill-0"], "decode": [f"decode-{i}" for i in range(4)]})
    streaming = Observation(requests=0, ttft_p90_s=None, itl_p90_s=2 * CONFIG.slo_itl_p90_s, prefill_waiting=0,
                            decode_waiting=0)
    assert not [d for _ in range(3 * CONFIG.down_after) for d in scaler.step(streaming)]
    assert scaler.count("decode") == 4
    # the prefill pool, with nothing to do, is cold as ever (at its minimum: nothing to drain)
    assert scaler.pools["prefill"].cold == 3 * CONFIG.down_after


def test_a_budget_of_gpus_weighs_each_pool_s_workers():
    """A TP4 prefill worker holds 4 of a 24-GPU budget, a TP8 decode worker 8: under a load both
    pools miss, 1 + 1 (12 GPUs) grows to what fits — never past 24, draining workers included."""
    gpus = AutoscaleConfig(min_prefill=1, max_prefill=6, min_decode=1, max_decode=6, budget=24, gpus=(4, 8),
                           interval_s=5.0, up_after=2, down_after=4, cooldown=1)
    cluster = FakeCluster(gpus.interval_s)
    scaler = Autoscaler(gpus, cluster, {"prefill": ["prefill-0"], "decode": ["decode-0"]})
    for rate in [3.0] * 30 + [0.0] * 60:  # then quiet until the backlog is served and the pools drained
        scaler.step(cluster.interval(rate))
        held = sum(4 if p["kind"] == "prefill" else 8 for p in cluster.alive.values())
        assert held == scaler.used <= 24
    grown = [(d.kind, d.action) for d in scaler.decisions if d.action == "add"]
    assert grown and 4 * (1 + grown.count(("prefill", "add"))) + 8 * (1 + grown.count(("decode", "add"))) >= 20
    assert (scaler.count("prefill"), scaler.count("decode")) == (1, 1)
    with pytest.raises(ValueError, match=r"minimums \(1 \+ 1 workers, 12 GPUs\) exceed the budget 10"):
        replace(gpus, budget=10)
    assert "24 GPUs (a prefill worker 4, a decode worker 8)" in gpus.describe()


def test_drains_before_removing_and_never_exceeds_the_budget():
    tight = AutoscaleConfig(min_prefill=1, max_prefill=6, min_decode=1, max_decode=6, budget=5, interval_s=5.0,
                            up_after=2, down_after=4, cooldown=1)
    load = [8.0] * 30 + [0.0] * 30 + [8.0] * 30  # far more than 5 workers can serve, twice
    cluster, scaler, history = _drive(tight, load)
    assert cluster.max_processes <= 5
    assert max(h[1] + h[2] for h in history) == 5  # it does use the whole budget
    for t, event, name in cluster.log:
        if event == "exit":  # every exit was preceded by a drain of that worker, two intervals before
            drains = [tt for tt, e, n in cluster.log if e == "drain" and n == name]
            assert drains and t - drains[0] >= 2
    assert any(e == "exit" for _, e, _ in cluster.log)


def test_constant_load_from_the_start_settles_and_stays():
    cluster, scaler, history = _drive(CONFIG, [2.0] * 80)
    late = [d for d in scaler.decisions if d.interval > 30]
    assert not late, late
    assert {(h[1], h[2]) for h in history[30:]} == {(history[-1][1], history[-1][2])}


def test_config_validation():
    with pytest.raises(ValueError, match="budget"):
        AutoscaleConfig(min_prefill=3, min_decode=3, budget=5)
    with pytest.raises(ValueError, match="down_after"):
        AutoscaleConfig(up_after=3, down_after=3)


def test_metrics_watcher_reads_interval_percentiles_from_the_gateway_text():
    def page(ttft_counts, total, waiting, in_flight=0):
        buckets = [0.1, 0.5, 1.0, 2.5]
        lines = [f'pdserve_time_to_first_token_seconds_bucket{{le="{b}"}} {c}' for b, c in zip(buckets, ttft_counts)]
        lines += [f'pdserve_time_to_first_token_seconds_bucket{{le="+Inf"}} {ttft_counts[-1]}',
                  f'pdserve_requests_total{{status="ok"}} {total}',
                  f'pdserve_requests_waiting{{service="gateway",instance="g"}} {waiting}',
                  f'pdserve_requests_running{{service="gateway",instance="g"}} {in_flight}',
                  'pdserve_requests_running{service="decode",instance="d0"} 7',
                  'pdserve_requests_waiting{service="decode",instance="d0"} 1',
                  f"pdserve_e2e_request_latency_seconds_count {total}",  # every request finished, here
                  f"pdserve_prompt_tokens_total {100 * total}", f"pdserve_generation_tokens_total {20 * total}",
                  f"pdserve_prefill_seconds_total {0.25 * total}",
                  "# HELP something", ]
        return "\n".join(lines)

    pages = iter([page([0, 0, 0, 0], 0, 0), page([5, 10, 10, 10], 10, 3, in_flight=4),
                  page([5, 10, 12, 30], 30, 0, in_flight=1), page([5, 10, 12, 30], 31, 0)])
    watcher = MetricsWatcher("http://gw", fetch=lambda url: next(pages))
    watcher.observe()
    first = watcher.observe()  # 10 answered and 4 still in flight: 14 arrived
    assert (first.requests, first.ttft_p90_s, first.prefill_waiting, first.decode_waiting) == (14, 0.5, 3, 1)
    assert first.finished == Load(finished=10, output_tokens=200, prefilled=10, prompt_tokens=1000, prefill_s=2.5)
    second = watcher.observe()  # 20 new observations: 2 ≤ 1.0 s, 18 in (1.0, 2.5]
    assert second.requests == 17 and second.ttft_p90_s == 2.5 and second.itl_p90_s is None
    assert second.decode_batch == 7
    assert second.load == {"d0": 8}  # a worker's running and waiting requests; the gateway's are not a worker's
    # traffic stopped: the last request in flight is answered, and nothing arrived
    assert watcher.observe().requests == 0
    assert histogram_p90({1.0: 0, float("inf"): 0}, {}) is None
    assert parse_prometheus('a_b{x="1"} 2.5\nbad line') == [("a_b", {"x": "1"}, 2.5)]


def test_a_pool_drains_its_least_loaded_worker_by_the_last_scrape():
    """Removing a worker drains the one holding the fewest requests (the least to finish, the fewest
    streams that might outlast the drain's grace and migrate); of equals, the newest."""
    cluster = FakeCluster(CONFIG.interval_s)
    cluster.spawn("decode"), cluster.spawn("decode")
    scaler = Autoscaler(CONFIG, cluster, {"prefill": ["prefill-0"], "decode": ["decode-0", "decode-1", "decode-2"]})
    quiet = Observation(requests=0, ttft_p90_s=None, itl_p90_s=None, prefill_waiting=0, decode_waiting=0,
                        load={"decode-0": 0, "decode-1": 3, "decode-2": 5})
    made = [d for _ in range(CONFIG.down_after) for d in scaler.step(quiet)]
    assert [(d.kind, d.name) for d in made] == [("decode", "decode-0")], made
    assert made[0].reason.endswith("it holds 0 requests")
    even = replace(quiet, load={"decode-1": 2, "decode-2": 2})
    made = [d for _ in range(CONFIG.down_after) for d in scaler.step(even)]
    assert [d.name for d in made] == ["decode-2"]  # of equals the newest


class SpawnOnly:
    """An actuator for tests that expect workers added and none removed: records the kinds spawned."""

    def __init__(self):
        self.spawned = []

    def spawn(self, kind):
        self.spawned.append(kind)
        return f"{kind}-{len(self.spawned)}"

    def drain(self, kind, name, load=None):
        raise AssertionError("no drain expected")

    def exited(self, name):
        return False


def test_colocated_has_one_pool_judged_by_ttft_and_itl():
    config = AutoscaleConfig(min_prefill=0, max_prefill=0, min_decode=1, max_decode=3, budget=3, interval_s=1.0,
                             colocated=True)
    hands = SpawnOnly()
    scaler = Autoscaler(config, hands, {"decode": ["colocated-0"]})
    slow_first_token = Observation(requests=10, ttft_p90_s=5.0, itl_p90_s=0.05, prefill_waiting=0, decode_waiting=0)
    for _ in range(config.up_after):
        scaler.step(slow_first_token)
    assert hands.spawned == ["decode"] and scaler.count("prefill") == 0  # TTFT alone makes the one pool hot


def test_live_loop_takes_a_baseline_then_decides_once_per_interval_and_skips_failed_scrapes():
    clock = [0.0]
    hot = Observation(requests=5, ttft_p90_s=9.0, itl_p90_s=None, prefill_waiting=0, decode_waiting=0)

    class Watcher:
        def __init__(self):
            self.scrapes, self.fail = 0, False

        def observe(self):
            self.scrapes += 1
            if self.fail:
                raise OSError("connection refused")
            return hot

    watcher, hands = Watcher(), SpawnOnly()
    config = AutoscaleConfig(interval_s=5.0, up_after=2, cooldown=0)
    live = LiveAutoscaler(config, "http://gw", hands, {"prefill": ["prefill-0"], "decode": ["decode-0"]},
                          watcher=watcher, clock=lambda: clock[0])
    assert live.tick() == [] and watcher.scrapes == 1  # the baseline: deltas start from here
    clock[0] = 4.9
    assert live.tick() == [] and watcher.scrapes == 1  # not yet an interval
    clock[0] = 5.0
    assert live.tick() == [] and watcher.scrapes == 2  # hot once
    watcher.fail, clock[0] = True, 10.0
    assert live.tick() == [] and live.autoscaler.interval == 1  # a failed scrape decides nothing
    watcher.fail, clock[0] = False, 15.0
    [decision] = live.tick()  # hot twice in a row: one prefill worker more
    assert (decision.kind, decision.action) == ("prefill", "add") and hands.spawned == ["prefill"]


def test_forecast_policy_on_local_workers_follows_a_step_and_stops():
    """`pdserve up --autoscale --policy forecast`: each pool started or drained to the forecast's
    count (3 req/s: 4 prefill at 1 req/s each with 10% headroom, 3 decode at 1.5), steady under the
    constant load, down to the minimum when traffic stops, draining ones within the budget."""
    from services.planner.autoscale import ForecastAutoscaler
    from services.planner.forecast import Capacity, ForecastScaler

    cluster = FakeCluster(5.0)
    scaler = ForecastScaler(Capacity(PREFILL_RATE, DECODE_RATE), interval_s=5.0, startup_s=5.0, headroom=0.1,
                            max_workers=(6, 4), budget=8)
    policy = ForecastAutoscaler(scaler, cluster, {"prefill": ["prefill-0"], "decode": ["decode-0"]})
    history = []
    for t, rate in enumerate([0.5] * 10 + [3.0] * 40 + [0.0] * 30):
        policy.step(cluster.interval(rate), now=5.0 * t)
        history.append((policy.count("prefill"), policy.count("decode")))
        assert policy.processes == len(cluster.alive) <= 8  # draining workers included
    assert history[10] != (4, 3) and history[11] == (4, 3)  # the interval after the step (backlog, then rate)
    assert not [d for d in policy.decisions if 13 < d.interval <= 51]  # steady under the constant load
    assert history[-1] == (1, 1) and policy.processes == 2
    for kind in ("prefill", "decode"):  # no flip: per pool, every add before every drain
        actions = [d.action for d in policy.decisions if d.kind == kind]
        assert actions == sorted(actions, key=lambda a: a == "drain"), actions


def test_forecast_policy_sized_from_the_profile_reads_the_mix_from_the_finished_requests():
    """No --capacity: the pools are sized from the shipped CPU profile and what finished lately. The
    same 1 req/s wants more prefill workers once the prompts take 1.2 s each instead of 0.3 s."""
    from services.planner.autoscale import ForecastAutoscaler
    from services.planner.forecast import ForecastScaler, ProfileSizer
    from shared.sim.cost import load_profile

    cluster = FakeCluster(5.0)
    sizer = ProfileSizer(load_profile(None), slo_ttft_s=2.0, slo_tpot_s=0.25, attainment=0.9, kv_path="shm")
    scaler = ForecastScaler(sizer, interval_s=5.0, startup_s=0.0, headroom=0.0, max_workers=(6, 4), budget=10)
    policy = ForecastAutoscaler(scaler, cluster, {"prefill": ["prefill-0"], "decode": ["decode-0"]})

    def interval(t, prefill_s):
        obs = replace(cluster.interval(1.0), finished=Load(finished=5, output_tokens=5 * 40, prefilled=5,
                                                           prompt_tokens=5 * 300, prefill_s=5 * prefill_s))
        policy.step(obs, now=5.0 * t)
        return policy.count("prefill")

    short = [interval(t, 0.3) for t in range(6)]
    long = [interval(t, 1.2) for t in range(6, 12)]
    assert scaler.mix.prefill_s == pytest.approx(1.2) and scaler.mix.prompt_tokens == pytest.approx(300)
    assert short[-1] < long[-1] <= 6
    assert long[-1] >= 2  # 1 req/s of 1.2 s prompts: more than one worker's worth of prefill
