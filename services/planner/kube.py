"""`pdserve planner`: the live planner of `pdserve up --autoscale`, on Kubernetes.

The same policy (autoscale.Autoscaler: hysteresis, cooldown, budget, scale to the minimum when
traffic stops) with the same inputs (every gateway's /metrics), but its decisions are replica
counts written to the prefill and decode Deployments' scale subresource:

    every interval:  the gateway Deployment's ready pods → scrape each /metrics → Observation
                     → Autoscaler.step → PATCH deployments/<pool>/scale {"spec": {"replicas": n±1}}

`--policy forecast` is the fleet's policy instead (services/planner/forecast.py, the one the
planning study of BENCHMARKS.md measures): each pool set to what the request rate forecast a
startup ahead, plus any backlog, needs within the SLOs — sized from one pod's engine profile
(`--profile`) and the finished requests' mix, or by a fixed req/s per pod (`--capacity`, as `pdserve
plan` prints it) — many pods at once, where the reactive policy moves one at a time.

A removal drains as a local one does: Kubernetes sends the pod it picks SIGTERM, and a worker
stops taking jobs, finishes what it holds and exits (within terminationGracePeriodSeconds). Which
pod it picks the planner steers: before a scale-down it marks the pod the gateways show holding
the fewest requests with a pod-deletion-cost of -1 (the ReplicaSet controller removes the lowest
cost first, among pods equally ready), as `up --autoscale` drains its least loaded worker. The
pod stays in the API with a deletionTimestamp until then, and counts against the budget until it
is gone. A count changed outside the planner (`kubectl scale`, `kubectl apply`) is adopted at the
next interval rather than fought.

The API is spoken directly over HTTPS with the pod's service account (deploy/k8s/components/planner
has the Role: get/patch deployments/scale, list/patch pods), or any server and token given on the command
line (`--kube-api`, `--kube-token-file`: a `kubectl proxy`, for running it from a laptop).
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import ssl
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from services.planner.autoscale import KINDS, AutoscaleConfig, LiveAutoscaler, MetricsWatcher, add_limit_args, \
    add_policy_args, forecast_scaler, limits_config
from services.planner.forecast import ForecastScaler
from shared.sim.workload import Load

log = logging.getLogger("pdserve.planner")

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"  # a ReplicaSet scales down the lowest first
MARK = "-1"  # this planner's mark: below the 0 of a pod without one
MARK_FRESH_S = 30.0  # a pod marked this recently is being removed; an older mark on a running pod is stale


class KubeClient:
    """The few Kubernetes API calls the planner makes."""

    def __init__(self, server: str, namespace: str, token_file: Path | None = None, ca_file: Path | None = None,
                 timeout_s: float = 10.0):
        self.server, self.namespace, self.token_file, self.timeout_s = server.rstrip("/"), namespace, token_file, timeout_s
        self.context = ssl.create_default_context(cafile=str(ca_file)) if ca_file else None

    @classmethod
    def in_cluster(cls, namespace: str | None = None) -> KubeClient:
        import os

        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise RuntimeError("not in a Kubernetes pod (no KUBERNETES_SERVICE_HOST): give --kube-api")
        ns = namespace or (SERVICE_ACCOUNT / "namespace").read_text().strip()
        return cls(f"https://{host}:{port}", ns, SERVICE_ACCOUNT / "token", SERVICE_ACCOUNT / "ca.crt")

    def _call(self, method: str, path: str, body: dict | None = None) -> dict[str, Any]:
        headers = {"Accept": "application/json"}
        if self.token_file is not None:  # read each time: projected tokens are rotated
            headers["Authorization"] = f"Bearer {self.token_file.read_text().strip()}"
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/merge-patch+json"
        req = urllib.request.Request(self.server + path, data=data, method=method, headers=headers)
        with urllib.request.urlopen(req, timeout=self.timeout_s, context=self.context) as resp:
            return json.loads(resp.read())

    def _scale_path(self, deployment: str) -> str:
        return f"/apis/apps/v1/namespaces/{self.namespace}/deployments/{deployment}/scale"

    def replicas(self, deployment: str) -> tuple[int, str]:
        """(spec.replicas, the pods' label selector) of a Deployment."""
        scale = self._call("GET", self._scale_path(deployment))
        return int(scale.get("spec", {}).get("replicas", 0)), scale.get("status", {}).get("selector", "")

    def gpus_per_pod(self, deployment: str) -> int:
        """The accelerators a Deployment's pod asks for: the `*/gpu` resource limits (nvidia.com/gpu,
        amd.com/gpu, …) of its containers, summed (0: a CPU pod)."""
        d = self._call("GET", f"/apis/apps/v1/namespaces/{self.namespace}/deployments/{deployment}")
        containers = d.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [])
        return sum(int(value) for c in containers for name, value in
                   (c.get("resources", {}).get("limits") or {}).items() if name.endswith("/gpu"))

    def set_replicas(self, deployment: str, n: int) -> None:
        self._call("PATCH", self._scale_path(deployment), {"spec": {"replicas": n}})

    def annotate_pod(self, name: str, key: str, value: str | None) -> None:
        """Set (None: remove) one annotation of a pod."""
        self._call("PATCH", f"/api/v1/namespaces/{self.namespace}/pods/{name}",
                   {"metadata": {"annotations": {key: value}}})

    def pods(self, selector: str) -> list[dict[str, Any]]:
        query = urllib.parse.urlencode({"labelSelector": selector})
        return self._call("GET", f"/api/v1/namespaces/{self.namespace}/pods?{query}").get("items", [])


def _ready(pod: dict[str, Any]) -> bool:
    conditions = pod.get("status", {}).get("conditions", [])
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


class KubeActuator:
    """autoscale.Actuator on Deployments. A worker's name is a slot, `<deployment>/<n>`: Kubernetes,
    not the planner, picks which pod a scale-down removes, so a drained name stands for "one pod
    of that Deployment terminating" and has exited when none is left terminating."""

    def __init__(self, client: KubeClient, deployments: dict[str, str]):
        self.client, self.deployments = client, deployments
        self._next = {kind: 0 for kind in deployments}
        self._selectors: dict[str, str] = {}
        self._marked: dict[str, float] = {}  # pods this planner gave the lowest deletion cost: when

    def _selector(self, deployment: str) -> str:
        """A Deployment's pod label selector (asked once: it does not change)."""
        if not self._selectors.get(deployment):
            self._selectors[deployment] = self.client.replicas(deployment)[1]
        return self._selectors[deployment]

    def counts(self) -> dict[str, int]:
        return {kind: self.client.replicas(d)[0] for kind, d in self.deployments.items()}

    def names(self, kind: str, n: int) -> list[str]:
        """`n` slot names for a pool (its current pods, as the planner counts them)."""
        self._next[kind] = max(self._next[kind], n)
        return [f"{self.deployments[kind]}/{i}" for i in range(n)]

    def spawn(self, kind: str) -> str:
        deployment = self.deployments[kind]
        n, _ = self.client.replicas(deployment)
        self.client.set_replicas(deployment, n + 1)
        name = f"{deployment}/{self._next[kind]}"
        self._next[kind] += 1
        return name

    def drain(self, kind: str, name: str, load: dict[str, float] | None = None) -> None:
        deployment = self.deployments[kind]
        if load:
            self._mark_least_loaded(deployment, load)
        n, _ = self.client.replicas(deployment)
        self.client.set_replicas(deployment, max(0, n - 1))

    def _mark_least_loaded(self, deployment: str, load: dict[str, float]) -> None:
        """Give the pod holding the fewest requests (`load`, by pod name: a worker's instance is its
        pod's name) the lowest deletion cost. A pod marked by this planner within the last
        MARK_FRESH_S is on its way out (several drains in one interval mark one pod each); an older
        mark on a pod still running is stale (its scale-down was undone) and is taken off. A pod
        the gateways do not show yet (just started) holds nothing. A failed call only leaves the
        choice to Kubernetes (the newest pods go first among equals)."""
        now = time.monotonic()
        try:
            pods = [p["metadata"] for p in self.client.pods(self._selector(deployment))
                    if not p.get("metadata", {}).get("deletionTimestamp")]
            going = {name for name, at in self._marked.items() if now - at < MARK_FRESH_S}
            for m in pods:  # stale marks off (this planner's only: a cost set by someone else stays)
                if m["name"] not in going and (m.get("annotations") or {}).get(DELETION_COST) == MARK:
                    self.client.annotate_pod(m["name"], DELETION_COST, None)
            left = [m for m in pods if m["name"] not in going]
            if left:
                least = min(left, key=lambda m: load.get(m["name"], 0.0))["name"]
                self.client.annotate_pod(least, DELETION_COST, MARK)
                self._marked[least] = now
            self._marked = {n: at for n, at in self._marked.items() if now - at < MARK_FRESH_S}
        except (OSError, KeyError, ValueError) as exc:
            log.warning("planner: could not mark the least loaded %s pod (%s); Kubernetes picks", deployment, exc)

    def terminating(self) -> dict[str, int]:
        """Pods of each pool still terminating (draining) now."""
        return {kind: sum(1 for p in self.client.pods(self._selector(d))
                          if p.get("metadata", {}).get("deletionTimestamp")) for kind, d in self.deployments.items()}

    def gpus(self) -> tuple[int, int]:
        """What a pod of each pool holds of the budget: the GPUs it asks for, where either pool's pods
        ask for any (a pool of CPU pods then holds none of it); else 1 each, counting pods."""
        gpus = tuple(self.client.gpus_per_pod(self.deployments[kind]) for kind in KINDS)
        return gpus if any(gpus) else (1, 1)

    def exited(self, name: str) -> bool:
        deployment = name.rsplit("/", 1)[0]
        return not any(p.get("metadata", {}).get("deletionTimestamp") for p in self.client.pods(self._selector(deployment)))

    def gateway_urls(self, deployment: str, port: int) -> list[str]:
        """The gateway pods that are ready now (each is scraped: behind the Service each scrape
        would reach another one, and their counters are their own)."""
        return [f"http://{p['status']['podIP']}:{port}" for p in self.client.pods(self._selector(deployment))
                if _ready(p) and not p.get("metadata", {}).get("deletionTimestamp") and p.get("status", {}).get("podIP")]


class KubePlanner:
    """The loop: adopt counts changed outside, then LiveAutoscaler.tick (observe, decide, write)."""

    def __init__(self, config: AutoscaleConfig, actuator: KubeActuator, gateway: str, gateway_port: int,
                 clock=time.monotonic):
        self.actuator = actuator
        counts = actuator.counts()
        initial = {kind: actuator.names(kind, counts[kind]) for kind in KINDS}
        watcher = MetricsWatcher(lambda: actuator.gateway_urls(gateway, gateway_port))
        self.live = LiveAutoscaler(config, "", actuator, initial, watcher=watcher, clock=clock)
        self.interval_s = config.interval_s

    def adopt(self) -> None:
        """Replica counts set by someone else (kubectl scale / apply) become the planner's count."""
        scaler = self.live.autoscaler
        for kind, n in self.actuator.counts().items():
            pool = scaler.pools[kind]
            if n != len(pool.active):
                log.warning("planner: %s has %d replicas, the planner counted %d: adopting %d", kind, n,
                            len(pool.active), n)
                pool.active = self.actuator.names(kind, n)
                pool.hot = pool.cold = pool.since_change = 0  # a change: its effect is seen before the next

    def tick(self):
        if self.live.due():
            self.adopt()
        return self.live.tick()


class ForecastKubePlanner:
    """`--policy forecast`: every interval, the gateways' arrivals and queues → ForecastScaler →
    each Deployment's replicas set to its target (counts changed outside are adopted first). Pods
    still terminating after a scale-down (draining) count against the budget until they are gone,
    as in the reactive policy."""

    def __init__(self, scaler: ForecastScaler, actuator: KubeActuator, gateway: str, gateway_port: int,
                 clock=time.monotonic):
        self.scaler, self.actuator, self.clock = scaler, actuator, clock
        self.interval_s = scaler.interval_s
        self.budget = scaler.budget
        self.watcher = MetricsWatcher(lambda: actuator.gateway_urls(gateway, gateway_port))
        self.arrived = 0  # requests seen by the gateways since the planner started
        self.load = Load()  # work they finished since then
        self._next: float | None = None

    def due(self) -> bool:
        return self._next is None or self.clock() >= self._next

    def tick(self) -> dict[str, int] | None:
        """The replica counts written this interval (None: not due, or the scrape failed)."""
        now = self.clock()
        if not self.due():
            return None
        self._next = now + self.scaler.interval_s
        try:
            obs = self.watcher.observe()
        except OSError as exc:
            log.warning("planner: scrape failed (%s); skipping an interval", exc)
            return None
        counts = self.actuator.counts()
        have = [counts[k] for k in KINDS]
        if self.scaler.current is not None and have != self.scaler.current:
            log.warning("planner: replicas are %s, the planner set %s: adopting them", have, self.scaler.current)
        self.arrived += obs.requests
        self.load += obs.finished
        terminating = self.actuator.terminating()
        leaving = self.scaler.cost(terminating[k] for k in KINDS)  # what draining pods still hold of the budget
        waiting = (round(obs.prefill_waiting), round(obs.decode_waiting))
        targets = dict(zip(KINDS, self.scaler.targets_for(now, self.arrived, waiting, have, leaving, self.budget,
                                                          self.load, (obs.tpot_mean_s, obs.decode_batch))))
        for kind, n in targets.items():
            if n != counts[kind]:
                log.info("planner: %s %d -> %d (forecast %.3g req/s)", kind, counts[kind], n, self.scaler.forecast())
                self.actuator.client.set_replicas(self.actuator.deployments[kind], n)
        return targets


def add_planner_args(p: argparse.ArgumentParser) -> None:
    k = p.add_argument_group("Kubernetes")
    k.add_argument("--kube-api", default=None,
                   help="the API server's URL (default: this pod's, with its service account)")
    k.add_argument("--kube-token-file", type=Path, default=None, help="a bearer token file (with --kube-api)")
    k.add_argument("--kube-ca-file", type=Path, default=None, help="the API server's CA (with an https --kube-api)")
    k.add_argument("--namespace", default=None, help="default: this pod's namespace")
    k.add_argument("--gateway-deployment", default="gateway")
    k.add_argument("--gateway-port", type=int, default=8000)
    k.add_argument("--prefill-deployment", default="prefill")
    k.add_argument("--decode-deployment", default="decode")
    g = p.add_argument_group("pools, budget (pods, or GPUs) and SLOs")
    add_limit_args(g, max_per_pool=8, what="pods (or their GPUs: --gpus-per-pod)")
    g.add_argument("--gpus-per-pod", type=_pair, default=None, metavar="PREFILL,DECODE",
                   help="what a prefill and a decode pod hold of --budget (default: the GPUs their Deployments' "
                        "pods ask for, e.g. 4,8 for TP4 prefill and TP8 decode; 1,1, counting pods, where they ask "
                        "for none)")
    add_policy_args(p.add_argument_group("policy"), what="pod", startup_s=120.0)


def _pair(text: str) -> tuple[int, int]:
    try:
        p, d = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected PREFILL,DECODE (two integers), got {text!r}") from None
    return p, d


def planner_from_args(args, gpus: tuple[int, int] | None = None,
                      stop: threading.Event | None = None) -> KubePlanner | ForecastKubePlanner | None:
    """The planner the flags ask for. Its budget weighs each pod by `gpus` (prefill, decode): given,
    or `--gpus-per-pod`, or read from the Deployments' pods (their GPU limits), asked again while
    the API server cannot be reached (None: `stop` was set first); the flags are checked before."""

    def built(gpus: tuple[int, int]):
        config = limits_config(args, gpus=gpus)
        forecast = args.policy == "forecast"
        return config, forecast_scaler(args, config, "pdserve planner", kv_path="network") if forecast else None

    config, scaler = built(gpus or args.gpus_per_pod or (1, 1))
    if args.kube_api:
        client = KubeClient(args.kube_api, args.namespace or "default", args.kube_token_file, args.kube_ca_file)
    else:
        client = KubeClient.in_cluster(args.namespace)
    actuator = KubeActuator(client, {"prefill": args.prefill_deployment, "decode": args.decode_deployment})
    if gpus is None and args.gpus_per_pod is None:
        read = _retrying(actuator.gpus, stop)
        if read is None:
            return None
        if read != (1, 1):
            config, scaler = built(read)
    log.info("%s", config.describe("pods"))
    if scaler is not None:
        log.info("policy: %s", scaler.describe())
        return ForecastKubePlanner(scaler, actuator, args.gateway_deployment, args.gateway_port)
    return KubePlanner(config, actuator, args.gateway_deployment, args.gateway_port)


def _retrying(call, stop: threading.Event | None, every_s: float = 5.0):
    """`call()`, again every `every_s` while the API server cannot be reached; None once `stop` is
    set (without one, the error is raised)."""
    while True:
        try:
            return call()
        except OSError as exc:
            if stop is None:
                raise
            log.warning("planner: %s; retrying in %g s", exc, every_s)
            if stop.wait(every_s):
                return None


def cmd_planner(args) -> int:
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    planner = planner_from_args(args, stop=stop)
    if planner is None:  # stopped before the API server answered
        return 0
    while not stop.is_set():
        try:
            planner.tick()
        except OSError as exc:  # the API server or a gateway unreachable: decide nothing blind, retry
            log.warning("planner: %s; retrying next interval", exc)
        stop.wait(min(1.0, planner.interval_s / 5))
    return 0
