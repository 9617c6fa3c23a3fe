"""`pdserve planner` on Kubernetes: the live planner's decisions written as replica counts.

There is no Kubernetes cluster on this machine (and none to download), so the API server here is a
stand-in: the few endpoints the planner calls (a Deployment's scale subresource, a label-selected
pod list), with the behaviour the planner depends on — a scale-down leaves the pod it removes
terminating (deletionTimestamp set) until its worker has drained and exited, and every call must
carry the service account's bearer token. The gateways are real HTTP servers serving Prometheus
text on two loopback addresses, scraped as pods."""

from __future__ import annotations

import json
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from services.planner.autoscale import AutoscaleConfig, MetricsWatcher
from services.planner.forecast import Capacity, ForecastScaler
from services.planner.kube import DELETION_COST, KubeActuator, KubeClient, KubePlanner
from shared.transport.servers import free_port

TOKEN = "sa-token"
NS = "pdserve"


class StandInKube:
    """Deployments as {name: replicas} and their pods; scaling creates ready pods or marks the
    newest ones terminating. `exit_terminating` is the kubelet seeing a drained worker exit."""

    def __init__(self, replicas: dict[str, int], gateway_ips: list[str], gpus: dict[str, int] | None = None):
        self.lock = threading.Lock()
        self.replicas = dict(replicas)
        self.gpus = gpus or {}  # a Deployment's pods' nvidia.com/gpu limit (none: CPU pods)
        self.pods: dict[str, list[dict]] = {d: [] for d in replicas}
        self.patches: list[tuple[str, int]] = []
        self.serial = 0
        self.lazy = False  # True: a scale takes effect at `settle()`, as a ReplicaSet acts after the write
        for d in replicas:
            self._reconcile(d)
        self.pods["gateway"] = [self._pod("gateway", ip) for ip in gateway_ips]
        self.replicas["gateway"] = len(gateway_ips)
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code, body):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _route(self, method):
                if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    return self._send(401, {"kind": "Status", "code": 401})
                url = urllib.parse.urlsplit(self.path)
                parts = url.path.strip("/").split("/")
                with stand_in.lock:
                    if parts[:5] == ["apis", "apps", "v1", "namespaces", NS] and parts[5] == "deployments" \
                            and parts[7:] == ["scale"] and parts[6] in stand_in.replicas:
                        d = parts[6]
                        if method == "PATCH":
                            assert self.headers["Content-Type"] == "application/merge-patch+json"
                            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                            stand_in.replicas[d] = body["spec"]["replicas"]
                            stand_in.patches.append((d, body["spec"]["replicas"]))
                            if not stand_in.lazy:
                                stand_in._reconcile(d)
                        return self._send(200, {"kind": "Scale", "spec": {"replicas": stand_in.replicas[d]},
                                                "status": {"replicas": stand_in.replicas[d],
                                                           "selector": f"app.kubernetes.io/component={d}"}})
                    if parts[:6] == ["apis", "apps", "v1", "namespaces", NS, "deployments"] and len(parts) == 7 \
                            and parts[6] in stand_in.replicas and method == "GET":
                        return self._send(200, stand_in.deployment(parts[6]))
                    if parts[:5] == ["api", "v1", "namespaces", NS, "pods"] and len(parts) == 6 and method == "PATCH":
                        assert self.headers["Content-Type"] == "application/merge-patch+json"
                        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                        pod = stand_in.pod(parts[5])
                        if pod is None:
                            return self._send(404, {"kind": "Status", "code": 404})
                        notes = pod["metadata"].setdefault("annotations", {})
                        for key, value in body["metadata"]["annotations"].items():  # merge patch: null removes
                            notes.pop(key, None) if value is None else notes.__setitem__(key, value)
                        return self._send(200, pod)
                    if parts == ["api", "v1", "namespaces", NS, "pods"] and method == "GET":
                        selector = urllib.parse.parse_qs(url.query)["labelSelector"][0]
                        d = selector.split("=", 1)[1]
                        return self._send(200, {"kind": "PodList", "items": list(stand_in.pods.get(d, []))})
                return self._send(404, {"kind": "Status", "code": 404})

            def do_GET(self):
                self._route("GET")

            def do_PATCH(self):
                self._route("PATCH")

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def deployment(self, d: str) -> dict:
        limits = {"cpu": "8", "memory": "64Gi"} | ({"nvidia.com/gpu": str(self.gpus[d])} if d in self.gpus else {})
        return {"kind": "Deployment", "metadata": {"name": d}, "spec": {"replicas": self.replicas[d], "template": {
            "spec": {"containers": [{"name": "pdserve", "resources": {"limits": limits}},
                                    {"name": "sidecar", "resources": {"limits": {"memory": "1Gi"}}}]}}}}

    def _pod(self, d: str, ip: str = "127.0.0.1") -> dict:
        self.serial += 1
        return {"metadata": {"name": f"{d}-{self.serial}", "labels": {"app.kubernetes.io/component": d}},
                "status": {"podIP": ip, "phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}}

    def pod(self, name: str) -> dict | None:
        return next((p for pods in self.pods.values() for p in pods if p["metadata"]["name"] == name), None)

    def _reconcile(self, d: str) -> None:
        """As a ReplicaSet: a scale-down removes (of pods equally ready) the lowest pod-deletion-cost
        first (none: 0), then the newest."""
        live = [p for p in self.pods[d] if "deletionTimestamp" not in p["metadata"]]
        for _ in range(self.replicas[d] - len(live)):
            self.pods[d].append(self._pod(d))
        ranked = sorted(enumerate(live), key=lambda ip: (int(ip[1]["metadata"].get("annotations", {}).get(
            DELETION_COST, 0)), -ip[0]))
        for _, pod in ranked[:max(0, len(live) - self.replicas[d])]:
            pod["metadata"]["deletionTimestamp"] = "2026-12-04T00:00:00Z"  # SIGTERM sent: draining

    def settle(self) -> None:
        with self.lock:
            for d in self.pods:
                if d != "gateway":
                    self._reconcile(d)

    def exit_terminating(self) -> None:
        with self.lock:
            for d in self.pods:
                self.pods[d] = [p for p in self.pods[d] if "deletionTimestamp" not in p["metadata"]]

    def scale_outside(self, d: str, n: int) -> None:  # kubectl scale
        with self.lock:
            self.replicas[d] = n
            self._reconcile(d)

    def terminating(self, d: str) -> int:
        return sum(1 for p in self.pods[d] if "deletionTimestamp" in p["metadata"])

    def close(self):
        self.server.shutdown()


class Gateway:
    """A gateway's /metrics on one loopback address: cumulative TTFT/ITL histograms and counters the
    test advances, plus the workers' gauges every gateway repeats."""

    BUCKETS = (0.01, 0.02, 0.04, 0.1, 0.25, 0.5, 1.0, 2.5)

    def __init__(self, ip: str, port: int):
        self.requests = self.waiting = self.count_itl = self.count_ttft = 0
        self.prompt_tokens = self.output_tokens = self.prefill_s = self.tpot_sum = 0.0
        self.decoding = 0  # sequences each decode worker holds, as the gauges say
        self.running: dict[str, int] = {}  # more decode workers' gauges: requests running, by pod name
        self.itl, self.ttft = dict.fromkeys(self.BUCKETS, 0), dict.fromkeys(self.BUCKETS, 0)
        gw = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                data = gw.page().encode()
                self.send_response(200 if self.path == "/metrics" else 404)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer((ip, port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def serve(self, n: int, itl_s: float, ttft_s: float = 0.2, prompt: int = 100, output: int = 11,
              prefill_s: float = 0.1) -> None:
        """`n` more requests, each with 10 token gaps of `itl_s` and a first token after `ttft_s`,
        finished with these token counts and prefill seconds (TPOT: `itl_s`)."""
        self.requests += n
        self.prompt_tokens += n * prompt
        self.output_tokens += n * output
        self.prefill_s += n * prefill_s
        self.tpot_sum += n * itl_s
        for b in self.BUCKETS:
            self.itl[b] += 10 * n if itl_s <= b else 0
            self.ttft[b] += n if ttft_s <= b else 0
        self.count_itl += 10 * n
        self.count_ttft += n

    def page(self) -> str:
        lines = [f'pdserve_requests_total{{status="ok"}} {self.requests}',
                 f'pdserve_requests_waiting{{service="gateway",instance="{id(self)}"}} {self.waiting}',
                 'pdserve_requests_waiting{service="decode",instance="decode-0"} 0',
                 f'pdserve_requests_running{{service="decode",instance="decode-0"}} {self.decoding}',
                 f"pdserve_e2e_request_latency_seconds_count {self.requests}",
                 f"pdserve_prompt_tokens_total {self.prompt_tokens}",
                 f"pdserve_generation_tokens_total {self.output_tokens}",
                 f"pdserve_prefill_seconds_total {self.prefill_s}",
                 f'gen_ai_server_time_per_output_token_seconds_sum{{gen_ai_operation_name="chat"}} {self.tpot_sum}',
                 f'gen_ai_server_time_per_output_token_seconds_count{{gen_ai_operation_name="chat"}} {self.requests}']
        lines += [f'pdserve_requests_running{{service="decode",instance="{pod}"}} {n}'
                  for pod, n in self.running.items()]
        for name, hist, total in (("pdserve_inter_token_latency_seconds", self.itl, self.count_itl),
                                  ("pdserve_time_to_first_token_seconds", self.ttft, self.count_ttft)):
            lines += [f'{name}_bucket{{le="{b}"}} {c}' for b, c in hist.items()]
            lines.append(f'{name}_bucket{{le="+Inf"}} {total}')
        return "\n".join(lines) + "\n"

    def close(self):
        self.server.shutdown()


@pytest.fixture
def system(tmp_path):
    port = free_port()
    gateways = [Gateway("127.0.0.1", port), Gateway("127.0.0.2", port)]
    kube = StandInKube({"prefill": 1, "decode": 1}, ["127.0.0.1", "127.0.0.2"])
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    client = KubeClient(kube.url, NS, token_file=token)
    yield kube, gateways, client, port
    kube.close()
    for g in gateways:
        g.close()


CONFIG = AutoscaleConfig(min_prefill=1, max_prefill=2, min_decode=1, max_decode=4, budget=4, interval_s=1.0,
                         up_after=2, down_after=4, cooldown=1, slo_ttft_p90_s=2.0, slo_itl_p90_s=0.05)


def test_decisions_become_replica_counts_within_the_budget_and_drains_finish_first(system):
    kube, gateways, client, port = system
    clock = [0.0]
    planner = KubePlanner(CONFIG, KubeActuator(client, {"prefill": "prefill", "decode": "decode"}), "gateway", port,
                          clock=lambda: clock[0])

    def interval(itl_s=None):
        if itl_s is not None:
            for g in gateways:
                g.serve(5, itl_s)
        planner.tick()
        clock[0] += CONFIG.interval_s

    interval()  # the baseline scrape
    for _ in range(12):  # decode's ITL p90 at 0.1 s, twice its SLO, on both gateways: hot
        interval(itl_s=0.1)
    decode_patches = [n for d, n in kube.patches if d == "decode"]
    assert decode_patches[:2] == [2, 3], kube.patches  # one at a time, after `up_after` hot intervals
    assert kube.replicas["decode"] == 3 and kube.replicas["prefill"] == 1  # the budget (4) stops it at 3
    assert all(d == "decode" for d, _ in kube.patches)  # prefill's TTFT (0.2 s) is within its SLO

    for _ in range(6):  # traffic stops: cold; one drain, then its pod terminating holds the budget
        interval()
    assert kube.replicas["decode"] == 2 and kube.terminating("decode") == 1
    planner_pools = planner.live.autoscaler.pools
    assert len(planner_pools["decode"].draining) == 1
    for _ in range(6):  # still terminating (draining): it counts; no further removal beyond the minimum rules
        interval()
    assert planner.live.autoscaler.processes <= CONFIG.budget
    kube.exit_terminating()  # the drained workers have exited
    for _ in range(12):
        interval()
        kube.exit_terminating()
    assert kube.replicas == {"prefill": 1, "decode": 1, "gateway": 2}  # down to the minimum
    assert not planner_pools["decode"].draining

    kube.scale_outside("decode", 3)  # kubectl scale: adopted, not fought at once
    for _ in range(CONFIG.down_after - 1):  # its cold streak starts again with the adopted count
        interval()
        assert len(planner_pools["decode"].active) == 3 and kube.replicas["decode"] == 3
    interval()  # then judged like any count: cold, so back towards the minimum
    assert kube.replicas["decode"] == 2


def test_a_scale_down_removes_the_pod_holding_the_fewest_requests(system):
    """Kubernetes, not the planner, picks the pod a scale-down removes (the newest, of pods equally
    ready): before scaling down the planner gives the pod the gateways show holding the fewest
    requests the lowest pod-deletion-cost, and takes an earlier mark off another."""
    kube, gateways, client, port = system
    kube.scale_outside("decode", 3)
    oldest, middle, newest = (p["metadata"]["name"] for p in kube.pods["decode"])
    client.annotate_pod(middle, DELETION_COST, "-1")  # left by an earlier scale-down that was undone
    for g in gateways:
        g.running = {oldest: 0, middle: 4, newest: 2}
    clock = [0.0]
    planner = KubePlanner(CONFIG, KubeActuator(client, {"prefill": "prefill", "decode": "decode"}), "gateway", port,
                          clock=lambda: clock[0])
    for _ in range(CONFIG.down_after + 1):  # the baseline, then no traffic: cold
        planner.tick()
        clock[0] += CONFIG.interval_s
    assert kube.replicas["decode"] == 2
    assert [p["metadata"]["name"] for p in kube.pods["decode"] if "deletionTimestamp" in p["metadata"]] == [oldest]
    assert {p["metadata"]["name"]: p["metadata"].get("annotations", {}).get(DELETION_COST)
            for p in kube.pods["decode"]} == {oldest: "-1", middle: None, newest: None}
    (decision,) = planner.live.autoscaler.decisions
    assert decision.action == "drain" and decision.kind == "decode"


def test_several_pods_drained_at_once_are_the_least_loaded_ones(system):
    """Two scale-downs before the ReplicaSet acts on the first (the forecast policy drains several
    pods in one interval): each marks another pod, the least loaded of those not already marked."""
    kube, _, client, _ = system
    kube.scale_outside("decode", 4)
    names = [p["metadata"]["name"] for p in kube.pods["decode"]]
    load = dict(zip(names, (5, 0, 1, 3)))  # the newest is not among the two least loaded
    actuator = KubeActuator(client, {"prefill": "prefill", "decode": "decode"})
    kube.lazy = True
    actuator.drain("decode", "decode/3", load)
    actuator.drain("decode", "decode/2", load)
    kube.settle()
    assert kube.replicas["decode"] == 2
    assert {p["metadata"]["name"] for p in kube.pods["decode"] if "deletionTimestamp" in p["metadata"]} == \
        {names[1], names[2]}


def test_gateways_are_scraped_one_by_one_and_summed():
    """Two gateways, each its own counters: the interval's p90 is over both; one restarting (its
    counters back at zero) only sets its baseline; the workers' gauge, repeated by both, counts once."""
    pages = {"a": [], "b": []}

    def page(requests, fast, slow, waiting_decode):
        return "\n".join([f'pdserve_requests_total{{status="ok"}} {requests}',
                          f'pdserve_inter_token_latency_seconds_bucket{{le="0.02"}} {fast}',
                          f'pdserve_inter_token_latency_seconds_bucket{{le="0.5"}} {fast + slow}',
                          f'pdserve_inter_token_latency_seconds_bucket{{le="+Inf"}} {fast + slow}',
                          f'pdserve_requests_waiting{{service="decode",instance="d0"}} {waiting_decode}'])

    pages["a"] = iter([page(0, 0, 0, 3), page(10, 100, 0, 3), page(0, 0, 0, 3)])
    pages["b"] = iter([page(5, 0, 0, 3), page(15, 0, 100, 3), page(25, 0, 105, 3)])
    watcher = MetricsWatcher(lambda: ["http://a", "http://b"], fetch=lambda url: next(pages[url[7]]))
    watcher.observe()
    both = watcher.observe()
    assert both.requests == 20 and both.itl_p90_s == 0.5 and both.decode_waiting == 3
    after_restart = watcher.observe()  # a's counters reset: only b's 10 requests and 5 slow gaps count
    assert after_restart.requests == 10 and after_restart.itl_p90_s == 0.5


def test_calls_carry_the_token_and_a_bad_one_is_an_error(system, tmp_path):
    kube, _, client, _ = system
    assert client.replicas("decode") == (1, "app.kubernetes.io/component=decode")
    bad = tmp_path / "bad"
    bad.write_text("nope")
    with pytest.raises(OSError, match="401"):
        KubeClient(kube.url, NS, token_file=bad).replicas("decode")


def _forecast_planner(system, **scaler_args):
    """`pdserve planner --policy forecast` on the stand-in (2 req/s a prefill pod, 5 a decode pod),
    and a function that runs one interval in which each gateway got `per_gateway` requests."""
    from services.planner.kube import ForecastKubePlanner

    _, gateways, client, port = system
    clock = [0.0]
    scaler = ForecastScaler(Capacity(2.0, 5.0), interval_s=10.0, headroom=0.0, max_workers=(20, 20), **scaler_args)
    planner = ForecastKubePlanner(scaler, KubeActuator(client, {"prefill": "prefill", "decode": "decode"}),
                                  "gateway", port, clock=lambda: clock[0])

    def interval(per_gateway=0):
        for g in gateways:
            g.serve(per_gateway, 0.01)
        out = planner.tick()
        clock[0] += scaler.interval_s
        return out

    return interval


def test_forecast_policy_sizes_both_pools_at_once_from_the_arrivals(system):
    kube = system[0]
    interval = _forecast_planner(system, startup_s=10.0, history=3, down_after=2, budget=30)
    interval()  # the baseline: the fleet as it is
    for _ in range(3):  # 2 gateways × 100 requests per 10 s: 20 req/s → 10 prefill, 4 decode
        interval(100)
    assert kube.replicas["prefill"] == 10 and kube.replicas["decode"] == 4
    assert [n for d, n in kube.patches if d == "prefill"] == [10]  # one write, not one pod at a time
    kube.scale_outside("decode", 6)  # kubectl scale: adopted as the count to hold or shrink from
    assert interval(100) == {"prefill": 10, "decode": 6}
    for _ in range(8):  # traffic stops: after the hysteresis, both to their minimum
        interval()
    assert kube.replicas["prefill"] == 1 and kube.replicas["decode"] == 1
    with pytest.raises(ValueError):
        Capacity(0.0, 1.0)


def test_forecast_policy_sized_from_the_profile_reads_the_mix_and_corrects_decode_by_the_tpot_seen(system):
    """No capacity given: `pdserve planner --policy forecast` sizes the Deployments from one pod's
    profile (the 70B TP8 roofline) and the mix the gateways' counters show; when the requests' time
    per token runs at twice what the profile says for the batch the decode pods hold, the decode
    Deployment grows to match."""
    from services.planner.forecast import ProfileSizer
    from services.planner.kube import ForecastKubePlanner
    from shared.sim.cost import load_profile
    from shared.sim.workload import Mix
    from tests.planner.test_study import ROOFLINE

    kube, gateways, client, port = system
    sizer = ProfileSizer(load_profile(ROOFLINE), slo_ttft_s=4.0, slo_tpot_s=0.040, attainment=0.95)
    clock = [0.0]
    scaler = ForecastScaler(sizer, interval_s=10.0, startup_s=10.0, headroom=0.0, history=3, max_workers=(200, 200),
                            budget=400)
    planner = ForecastKubePlanner(scaler, KubeActuator(client, {"prefill": "prefill", "decode": "decode"}),
                                  "gateway", port, clock=lambda: clock[0])
    mix = Mix(prefill_s=0.25, prompt_tokens=7000, output_tokens=180)
    batch, step = sizer.batch(mix)

    def interval(tpot_s):
        for g in gateways:  # 2 × 500 requests per 10 s: 100 req/s
            g.decoding = batch
            g.serve(500, tpot_s, prompt=7000, output=180, prefill_s=0.25)
        planner.tick()
        clock[0] += scaler.interval_s

    interval(step)  # the baseline
    for _ in range(3):
        interval(step)
    want = (sizer.workers(0, 100.0, mix), sizer.workers(1, 100.0, mix))
    assert (kube.replicas["prefill"], kube.replicas["decode"]) == want and want[0] > 20
    assert scaler.decode_factor == pytest.approx(1.0, rel=0.01)
    for _ in range(4):  # the same load, each token twice as slow as the profile's step at that batch
        interval(2 * step)
    assert scaler.decode_factor > 1.8
    assert kube.replicas["prefill"] == want[0] and kube.replicas["decode"] > want[1]


@pytest.mark.parametrize("flags, says", [(["--capacity", "0,5"], "must be positive"),
                                         (["--capacity", "2"], "PREFILL_RPS,DECODE_RPS"),
                                         (["--profile", "/nonexistent/gpu.json"], "not found"),
                                         (["--slo-itl-p90-ms", "-5"], "positive SLOs"),
                                         (["--capacity", "2,5", "--min-prefill", "0"], "1 <= min")])
def test_forecast_policy_bad_flags_are_a_clear_error(flags, says):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "services.cli", "planner", "--policy", "forecast", "--kube-api",
                           "http://127.0.0.1:1", *flags], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_forecast_policy_counts_terminating_pods_against_the_budget(system):
    kube = system[0]
    interval = _forecast_planner(system, startup_s=0.0, history=2, down_after=1, budget=16)
    interval()
    interval(100)  # 20 req/s: 10 prefill + 4 decode
    assert (kube.replicas["prefill"], kube.replicas["decode"]) == (10, 4)
    for _ in range(3):  # quiet: down to the minimum, 12 pods left draining
        interval()
    assert (kube.replicas["prefill"], kube.replicas["decode"]) == (1, 1)
    assert kube.terminating("prefill") + kube.terminating("decode") == 12
    interval(100)  # the load is back while they drain: 16 − 12 pods of budget for both pools
    assert kube.replicas["prefill"] + kube.replicas["decode"] <= 4
    kube.exit_terminating()
    interval(100)
    assert (kube.replicas["prefill"], kube.replicas["decode"]) == (10, 4)


def test_up_forecast_policy_sizes_from_the_shipped_profile_unless_given_a_capacity():
    import subprocess
    import sys

    def up(*flags):
        return subprocess.run([sys.executable, "-m", "services.cli", "up", "--autoscale", "--policy", "forecast",
                               "--dry-run", *flags], capture_output=True, text=True, timeout=60)

    default = up()
    assert default.returncode == 0 and "policy: forecast, each pool sized from the profile" in default.stdout
    assert "10% headroom" in default.stdout
    given = up("--capacity", "2,5", "--headroom", "0.02,0.08")
    assert "policy: forecast, 2 and 5 req/s a prefill and a decode worker, 2% prefill, 8% decode headroom" \
        in given.stdout
    seasonal = up("--capacity", "2,5", "--season-s", "86400")
    assert "headroom, 10 s from adding one to serving, the load of 86400 s ago where it repeats" in seasonal.stdout
    short = up("--season-s", "20")  # a startup of 10 s and three intervals of 5 s: 25 s at least
    assert short.returncode != 0 and "a season must span a startup" in short.stdout + short.stderr
    reactive = subprocess.run([sys.executable, "-m", "services.cli", "up", "--autoscale", "--dry-run", "--season-s",
                               "86400"], capture_output=True, text=True, timeout=60)
    assert reactive.returncode == 2 and "--season-s is the forecast policy's" in reactive.stderr
    bad = up("--headroom", "0.1,-1")
    assert bad.returncode == 2 and "--headroom: takes H or PREFILL,DECODE" in bad.stderr
    missing = up("--profile", "/nonexistent/gpu.json")
    assert missing.returncode != 0 and "not found" in missing.stdout + missing.stderr
    assert "Traceback" not in missing.stdout + missing.stderr


def test_a_schedule_floor_needs_the_forecast_policy_and_a_plan_file(tmp_path):
    import subprocess
    import sys

    bad = tmp_path / "plan.json"
    bad.write_text("[1, 2]")
    for flags, says in ((["--policy", "reactive", "--schedule", str(bad)], "--policy forecast"),
                        (["--policy", "forecast", "--capacity", "2,5", "--schedule", str(bad)], "plan --forecast"),
                        (["--policy", "forecast", "--capacity", "2,5", "--schedule", str(tmp_path / "none.json")],
                         "none.json")):
        proc = subprocess.run([sys.executable, "-m", "services.cli", "planner", "--kube-api", "http://127.0.0.1:1",
                               *flags], capture_output=True, text=True, timeout=60)
        assert proc.returncode != 0 and says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_forecast_policy_with_a_schedule_holds_its_pods_ahead_of_the_load(system):
    """`pdserve planner --policy forecast --schedule PLAN.json`: no traffic yet, and the replicas are
    the schedule's for now; a load above it is followed as before."""
    from services.planner.schedule import Schedule

    kube = system[0]
    plan = {"recommended": {"mode": "disaggregated"}, "clock": False, "startup_s": 0.0,
            "periods": [{"start_s": 0.0, "prefill": 4, "decode": 2}]}
    interval = _forecast_planner(system, startup_s=10.0, history=3, down_after=2, budget=30,
                                 floor=Schedule(plan, 10.0).floor)
    interval()
    assert (kube.replicas["prefill"], kube.replicas["decode"]) == (4, 2)
    for _ in range(3):
        interval(100)  # 20 req/s: 10 prefill, 4 decode
    assert (kube.replicas["prefill"], kube.replicas["decode"]) == (10, 4)
    for _ in range(8):  # traffic stops: down to the schedule's pods, not the minimum
        interval()
    assert (kube.replicas["prefill"], kube.replicas["decode"]) == (4, 2)


def test_the_budget_counts_the_gpus_a_pod_asks_for(system, tmp_path):
    """TP4 prefill pods and TP8 decode pods: `pdserve planner` reads each pool's GPUs from its
    Deployment and holds the pools within a budget of GPUs — both grown in proportion when the
    forecast wants more than it, pods still terminating weighed by their GPUs. `--gpus-per-pod`
    overrides what the Deployments say; pods that ask for no GPU count one each."""
    from services.cli import build_parser
    from services.planner.kube import ForecastKubePlanner, planner_from_args

    kube, gateways, _, port = system
    token = tmp_path / "token"

    def planner(*flags):
        args = build_parser().parse_args(["planner", "--kube-api", kube.url, "--namespace", NS, "--kube-token-file",
                                          str(token), "--gateway-port", str(port), *flags])
        return planner_from_args(args)

    reactive = planner("--budget", "10")
    assert reactive.live.config.gpus == (1, 1) and reactive.live.config.budget == 10  # CPU pods: pods
    kube.gpus = {"prefill": 4, "decode": 8}
    reactive = planner()
    assert reactive.live.config.gpus == (4, 8) and reactive.live.config.budget == 8 * 4 + 8 * 8  # both at max
    assert planner("--gpus-per-pod", "2,2").live.config.gpus == (2, 2)
    with pytest.raises(ValueError, match="exceed the budget 10"):  # 1 + 1 pods hold 12 GPUs
        planner("--budget", "10")

    clock = [0.0]
    forecast = planner("--policy", "forecast", "--capacity", "2,5", "--budget", "48", "--headroom", "0",
                       "--startup-s", "0", "--autoscale-interval", "10", "--max-prefill", "20", "--max-decode", "20")
    assert isinstance(forecast, ForecastKubePlanner) and forecast.scaler.gpus == (4, 8)
    forecast.clock = lambda: clock[0]

    def interval(per_gateway=0):
        for g in gateways:
            g.serve(per_gateway, 0.01)
        forecast.tick()
        clock[0] += 10.0
        return kube.replicas["prefill"], kube.replicas["decode"]

    interval()
    # 20 req/s wants 10 prefill + 4 decode pods: 72 GPUs; within 48, each pool two thirds of its want
    for _ in range(2):
        p, d = interval(100)
        assert 4 * p + 8 * d <= 48 and p >= 6 and d >= 2, (p, d)
    for _ in range(forecast.scaler.down_after + 1):  # quiet: down to one pod each, the rest terminating
        interval()
    assert (kube.replicas["prefill"], kube.replicas["decode"]) == (1, 1)
    leaving = 4 * kube.terminating("prefill") + 8 * kube.terminating("decode")
    p, d = interval(100)  # the load back while they drain: their GPUs still held
    assert 4 * p + 8 * d + leaving <= 48, (p, d, leaving)
