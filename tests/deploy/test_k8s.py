"""The deployment files, checked offline (no cluster, no network): the kustomize overlays under
deploy/k8s render (kubectl kustomize), every rendered object is valid against the Kubernetes
schema (kubernetes-validate's bundled schemas, strict), the YAML passes yamllint, the invariants
pdserve depends on hold (one kvstore per node sharing the node's /dev/shm with the workers, the
store name derived from the node name on both sides, NATS clustered with JetStream, Valkey with a
replica, probes, PDBs, HPAs), every service's command line parses with that service's own parser,
and docker-compose.yml is valid against the compose-spec schema and wired like the manifests."""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("dev", "production")
KUBE_VERSION = "1.30"  # the oldest Kubernetes the manifests are written for
# the one `make tools` installs into the virtualenv (scripts/get_kubectl.py: v1.33.9), else one on PATH
KUBECTL = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")
SERVICES = ("gateway", "prefill", "decode", "kvstore")  # the pdserve image's entry points
WORKERS = ("prefill", "decode")
ENTRYPOINT = "/etc/pdserve/entrypoint.sh"


class Manifests:
    """The objects one overlay renders to."""

    def __init__(self, overlay: str, objects: list[dict]):
        self.overlay, self.objects = overlay, objects

    def all(self, kind: str) -> list[dict]:
        return [o for o in self.objects if o["kind"] == kind]

    def get(self, kind: str, name: str) -> dict:
        found = [o for o in self.all(kind) if o["metadata"]["name"] == name]
        assert len(found) == 1, f"{self.overlay}: expected one {kind} {name}, found {len(found)}"
        return found[0]

    def component(self, component: str) -> list[dict]:
        """The workloads (objects with a pod template) of one component."""
        return [o for o in self.objects if "template" in o.get("spec", {})
                and o["metadata"]["labels"].get("app.kubernetes.io/component") == component]

    def workload(self, component: str) -> dict:
        (found,) = self.component(component)
        return found

    def container(self, component: str, name: str = "pdserve") -> dict:
        (found,) = [c for c in pod(self.workload(component))["containers"] if c["name"] == name]
        return found

    def configmap_data(self, container: dict) -> dict[str, str]:
        data = {}
        for source in container.get("envFrom", []):
            data |= self.get("ConfigMap", source["configMapRef"]["name"])["data"]
        return data

    def env(self, container: dict) -> dict[str, str]:
        """The container's environment as far as the manifests fix it (downward-API and Secret
        values as placeholders)."""
        out = self.configmap_data(container)
        for var in container.get("env", []):
            out[var["name"]] = var.get("value", f"<{', '.join(var.get('valueFrom', {}))}>")
        return out

    def argv(self, container: dict) -> list[str]:
        """command + args with $(VAR) expanded as the kubelet does."""
        env = self.env(container)
        return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a)
                for a in container.get("command", []) + container.get("args", [])]


def pod(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def module_of(argv: list[str]) -> tuple[str, list[str]]:
    """(module, its arguments) from a pdserve container's or compose service's command line."""
    if argv[:2] == ["python", "-m"]:
        return argv[2], argv[3:]
    if argv[:2] == ["sh", ENTRYPOINT]:  # entrypoint.sh ends in `exec python -m "$@"`
        return argv[2], argv[3:]
    if argv[0] == "pdserve" and argv[1] in SERVICES:  # services/cli.py: pdserve X → services.X.__main__
        return f"services.{argv[1]}", argv[2:]
    raise AssertionError(f"not a pdserve service command line: {argv}")


@pytest.fixture(scope="module", params=OVERLAYS)
def k8s(request) -> Manifests:
    if KUBECTL is None:
        pytest.skip("kubectl is not installed (make tools installs it): it renders the kustomize overlays")
    out = subprocess.run([KUBECTL, "kustomize", str(K8S / "overlays" / request.param)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, f"kubectl kustomize {request.param}: {out.stderr}"
    return Manifests(request.param, [o for o in yaml.safe_load_all(out.stdout) if o])


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


# ------------------------------------------------------------------------------------ validity


def test_every_object_is_valid_against_the_kubernetes_schema(k8s):
    import kubernetes_validate

    errors = []
    for obj in k8s.objects:
        try:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{obj['kind']}/{obj['metadata']['name']}: {exc.message}")
    assert not errors, "\n".join(errors)


def test_yamllint():
    from yamllint import config, linter

    conf = config.YamlLintConfig(file=str(K8S / ".yamllint"))
    files = sorted(K8S.rglob("*.yaml")) + [K8S / ".yamllint"]
    problems = [f"{f.relative_to(ROOT)}:{p.line}: {p.desc}" for f in files
                for p in linter.run(f.read_text(), conf, str(f))]
    assert not problems, "\n".join(problems)


def test_compose_is_valid_against_the_compose_spec(compose):
    schema = json.loads((ROOT / "deploy" / "compose-spec.schema.json").read_text())
    validator = jsonschema.validators.validator_for(schema)(schema)
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(compose)]
    assert not errors, "\n".join(errors)


# ---------------------------------------------------------------------------------- invariants


def test_one_kvstore_per_node_sharing_the_nodes_shm_with_the_workers(k8s):
    (kvstore,) = k8s.component("kvstore")
    assert kvstore["kind"] == "DaemonSet"
    for component in ("kvstore", *WORKERS):
        spec = pod(k8s.workload(component))
        shm = [v["name"] for v in spec["volumes"] if v.get("hostPath", {}).get("path") == "/dev/shm"]
        assert shm, f"{component}: no hostPath /dev/shm volume"
        mounts = {m["name"]: m["mountPath"] for m in k8s.container(component)["volumeMounts"]}
        assert mounts.get(shm[0]) == "/dev/shm", f"{component}: the node's /dev/shm is not at /dev/shm"


def test_workers_name_their_nodes_kvstore_as_the_kvstore_names_itself(k8s, tmp_path):
    scripts = set()
    for component in ("kvstore", *WORKERS):
        container = k8s.container(component)
        assert container["command"][:2] == ["sh", ENTRYPOINT], component
        node = [v for v in container["env"] if v["name"] == "NODE_NAME"]
        assert node and node[0]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName", component
        # nothing overrides the name entrypoint.sh derives
        assert "PDSERVE_KVSTORE" not in k8s.env(container), component
        assert not {"--store", "--kvstore"} & set(container.get("args", [])), component
        (volume,) = [v for v in pod(k8s.workload(component))["volumes"] if "configMap" in v
                     and any(m["name"] == v["name"] and m["mountPath"] == os.path.dirname(ENTRYPOINT)
                             for m in container["volumeMounts"])]
        scripts.add(volume["configMap"]["name"])
    assert len(scripts) == 1, f"kvstore and workers run different entry-point scripts: {scripts}"

    # run the script with a stand-in python that prints what it was given
    from services.kvstore.config import _STORE_NAME

    script = tmp_path / "entrypoint.sh"
    script.write_text(k8s.get("ConfigMap", scripts.pop())["data"]["entrypoint.sh"])
    (tmp_path / "bin").mkdir()
    fake = tmp_path / "bin" / "python"
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$PDSERVE_KVSTORE" "$@"\n')
    fake.chmod(0o755)
    env = {"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", "NODE_NAME": "ip-10-0-1-5.ec2.internal"}
    out = subprocess.run(["sh", str(script), "services.decode", "--x"], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    store, *argv = out.stdout.splitlines()
    assert store == "kv-ip-10-0-1-5-ec2-internal" and _STORE_NAME.fullmatch(store)
    assert argv == ["-m", "services.decode", "--x"]
    del env["NODE_NAME"]
    assert subprocess.run(["sh", str(script), "services.decode"], env=env, capture_output=True).returncode != 0


def test_prefill_and_decode_are_separate_pools(k8s):
    sizes = {}
    for component in WORKERS:
        (workload,) = k8s.component(component)
        assert workload["kind"] == "Deployment"
        resources = k8s.container(component)["resources"]
        assert {"cpu", "memory"} <= resources["requests"].keys(), component
        sizes[component] = (workload["spec"]["replicas"], resources["requests"]["cpu"])
    if k8s.overlay == "production":  # sized apart, not one pool under two names
        assert sizes["prefill"] != sizes["decode"]
    for component in ("gateway", "kvstore"):
        assert k8s.container(component)["resources"]["requests"], component


def test_probes_on_the_health_endpoints(k8s):
    from services.gateway.routes import router

    routes = {getattr(r, "path", None) for r in router.routes}  # the top-level routes (/health, /version)
    gateway = k8s.container("gateway")
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/health"
    # /health is 503 while starting or while no worker is alive: never the liveness check
    assert gateway["livenessProbe"]["httpGet"]["path"] != "/health"
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert gateway[probe]["httpGet"]["path"] in routes, probe
    nats = k8s.container("nats", "nats")
    for probe in ("readinessProbe", "livenessProbe"):
        assert nats[probe]["httpGet"]["path"].startswith("/healthz"), probe
    assert len(k8s.component("valkey")) == 2
    for workload in k8s.component("valkey"):
        for container in pod(workload)["containers"]:
            assert "readinessProbe" in container and "livenessProbe" in container, workload["metadata"]["name"]
    for component in ("kvstore", *WORKERS):  # no HTTP port: no HTTP probe (README.md)
        container = k8s.container(component)
        assert "ports" not in container
        assert not any("httpGet" in container.get(p, {}) for p in ("readinessProbe", "livenessProbe")), component


def test_nats_is_a_three_server_jetstream_cluster(k8s):
    from shared.transport.servers import NATS_ROUTE_LIVENESS, nats_server_binary

    nats = k8s.get("StatefulSet", "nats")
    assert nats["spec"]["replicas"] == 3
    headless = k8s.get("Service", nats["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"]
    (volume,) = [v for v in pod(nats)["volumes"] if "configMap" in v]
    conf = k8s.get("ConfigMap", volume["configMap"]["name"])["data"]["nats.conf"]
    assert re.search(r"^jetstream\s*\{", conf, re.M) and re.search(r"^cluster\s*\{", conf, re.M)
    assert NATS_ROUTE_LIVENESS in conf  # the routes' liveness, as in pdserve's own clusters
    cluster_port = re.search(r"^\s+port:\s*(\d+)", conf[conf.index("cluster"):], re.M).group(1)
    routes = re.findall(r"nats://(\S+):(\d+)", conf)
    assert sorted(routes) == [(f"nats-{i}.{headless['metadata']['name']}", cluster_port) for i in range(3)]
    store_dir = re.search(r"store_dir:\s*(\S+)", conf).group(1)
    (claim,) = nats["spec"]["volumeClaimTemplates"]
    mounts = {m["name"]: m["mountPath"] for m in k8s.container("nats", "nats")["volumeMounts"]}
    assert mounts[claim["metadata"]["name"]] == store_dir

    # the real server checks the file
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"pdserve-test-nats-{os.getpid()}.conf"
    path.write_text(conf)
    try:
        out = subprocess.run([nats_server_binary(), "-t", "-c", str(path)], capture_output=True, text=True,
                             env={"POD_NAME": "nats-0", "PDSERVE_NATS_TOKEN": "t"}, timeout=30)
    finally:
        path.unlink()
    assert out.returncode == 0, out.stderr


def test_valkey_primary_has_a_replica(k8s):
    primary_url = urlsplit(k8s.configmap_data(k8s.container("gateway"))["PDSERVE_REDIS_URL"])
    primary = k8s.get("Service", primary_url.hostname)
    replicas = [w for w in k8s.component("valkey") if "--replicaof" in pod(w)["containers"][0]["args"]]
    assert len(replicas) == 1
    args = pod(replicas[0])["containers"][0]["args"]
    assert args[args.index("--replicaof") + 1:][:2] == [primary_url.hostname, str(primary_url.port)]
    # the primary's Service selects the primary only
    selected = [w for w in k8s.component("valkey")
                if primary["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()]
    assert len(selected) == 1 and selected[0] is not replicas[0]


def test_disruption_budgets_and_autoscalers(k8s):
    budgets = {b["metadata"]["name"]: b for b in k8s.all("PodDisruptionBudget")}
    for component in ("gateway", "decode", "nats"):
        matching = [b for b in budgets.values() if b["spec"]["selector"]["matchLabels"].items()
                    <= k8s.workload(component)["spec"]["template"]["metadata"]["labels"].items()]
        assert matching, f"no PodDisruptionBudget covers {component}"
    scaled = {h["spec"]["scaleTargetRef"]["name"]: h for h in k8s.all("HorizontalPodAutoscaler")}
    planned = {"prefill", "decode"} if k8s.component("planner") else set()
    assert "gateway" in scaled and ("decode" in scaled or "decode" in planned)
    assert not scaled.keys() & planned, "an HPA and the planner would both write one replica count"
    for hpa in scaled.values():
        assert hpa["apiVersion"] == "autoscaling/v2" and 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]


def test_the_planner_may_only_scale_the_pools_and_its_flags_parse(k8s):
    """`pdserve planner` (components/planner, in both overlays): its command line parses with pdserve's
    own parser; its bounds hold the pools' starting counts; its service account can read and write
    the pools' scale subresource, read their Deployments, list pods and patch them (the deletion-cost
    mark on the least loaded pod before a scale-down), nothing more."""
    from services.cli import build_parser
    from services.planner.autoscale import limits_config

    container = k8s.container("planner", "planner")
    argv = k8s.argv(container)
    assert argv[:2] == ["pdserve", "planner"]
    try:
        args = build_parser().parse_args(argv[1:])
    except SystemExit:
        pytest.fail(f"pdserve rejects {argv}")
    config = limits_config(args)
    for kind in ("prefill", "decode"):
        lo, hi = config.bounds(kind)
        assert lo <= k8s.workload(kind)["spec"]["replicas"] <= hi, kind
    assert config.min_prefill + config.min_decode <= config.budget
    account = pod(k8s.workload("planner"))["serviceAccountName"]
    (binding,) = [b for b in k8s.all("RoleBinding") if {"kind": "ServiceAccount", "name": account}.items()
                  <= b["subjects"][0].items()]
    role = k8s.get("Role", binding["roleRef"]["name"])
    grants = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
              for v in rule["verbs"]}
    assert grants == {("apps", "deployments/scale", "get"), ("apps", "deployments/scale", "patch"),
                      ("apps", "deployments", "get"), ("", "pods", "list"), ("", "pods", "patch")}


def test_connection_settings(k8s):
    nats_url = k8s.configmap_data(k8s.container("gateway"))["PDSERVE_NATS_URL"]
    from nats.aio.client import Client  # what shared/transport/nats_bus.connect hands each URL to

    for url in nats_url.split(","):
        Client()._parse_server_uri(url.strip())
    service = k8s.get("Service", urlsplit(nats_url).hostname)
    assert service["spec"]["selector"] == {"app.kubernetes.io/component": "nats"}
    assert urlsplit(nats_url).port in [p["port"] for p in service["spec"]["ports"]]
    secrets = {v["valueFrom"]["secretKeyRef"]["name"] for o in k8s.objects if "template" in o.get("spec", {})
               for c in pod(o)["containers"] for v in c.get("env", []) if "secretKeyRef" in v.get("valueFrom", {})}
    assert len(secrets) == 1
    generated = k8s.all("Secret")
    if k8s.overlay == "production":  # created by hand (README.md): no credentials in git
        assert not generated
    else:
        assert [s["metadata"]["name"] for s in generated] == list(secrets)


def test_the_model_is_on_disk_in_every_pdserve_pod(k8s):
    for component in SERVICES:
        container = k8s.container(component)
        model = Path(k8s.env(container)["PDSERVE_MODEL"])
        assert model.is_absolute() and model.suffix == ".gguf", component
        if k8s.overlay == "production":
            mounts = {m["name"]: m for m in container["volumeMounts"]}
            claims = {v["name"] for v in pod(k8s.workload(component))["volumes"] if "persistentVolumeClaim" in v}
            assert any(str(model).startswith(mounts[c]["mountPath"] + "/") and mounts[c]["readOnly"]
                       for c in claims), f"{component}: {model} is not on the model volume"


def test_env_names_are_read_by_the_code(k8s):
    read = {m for d in ("services", "shared") for p in (ROOT / d).rglob("*.py")
            for m in re.findall(r"[\"'](PDSERVE_\w+)[\"']", p.read_text())}
    for component in SERVICES:
        names = {n for n in k8s.env(k8s.container(component)) if n.startswith("PDSERVE_")}
        unread = names - read
        assert not unread, f"{component}: nothing in services/ or shared/ reads {sorted(unread)}"


# -------------------------------------------------- command lines, and compose and k8s agreeing


def parse(module: str, args: list[str]):
    """The service's own parser over these arguments (a bad flag fails here, not in the cluster)."""
    parser = importlib.import_module(f"{module}.__main__").build_parser()
    try:
        return parser.parse_args(args)
    except SystemExit:
        pytest.fail(f"{module} rejects {args}")


def k8s_services(k8s: Manifests) -> dict[str, tuple[str, list[str], str]]:
    """component → (module, args, image) for every pdserve workload."""
    out = {}
    for workload in k8s.objects:
        labels = workload["metadata"].get("labels", {})
        if "template" in workload.get("spec", {}) and labels.get("app.kubernetes.io/name") == "pdserve":
            container = k8s.container(labels["app.kubernetes.io/component"])
            out[labels["app.kubernetes.io/component"]] = (*module_of(k8s.argv(container)), container["image"])
    return out


def compose_services(compose: dict) -> dict[str, tuple[str, list[str], str]]:
    return {name: (*module_of(s["command"]), s["image"]) for name, s in compose["services"].items()
            if s.get("command", [""])[0] == "pdserve"}


def test_commands_are_the_repos_entry_points(k8s, compose):
    for where, services in (("k8s", k8s_services(k8s)), ("compose", compose_services(compose))):
        assert set(services) == set(SERVICES), where
        for component, (module, args, _) in services.items():
            assert module == f"services.{component}", f"{where}: {component} runs {module}"
            assert (ROOT / module.replace(".", "/") / "__main__.py").is_file()
            parse(module, args)
        images = {image.rsplit(":", 1)[0].rsplit("/", 1)[-1] for _, _, image in services.values()}
        assert images == {"pdserve"}, f"{where}: {images}"
    k8s_gateway = parse("services.gateway", k8s_services(k8s)["gateway"][1])
    compose_gateway = parse("services.gateway", compose_services(compose)["gateway"][1])
    assert (k8s_gateway.host, k8s_gateway.port) == (compose_gateway.host, compose_gateway.port) == ("0.0.0.0", 8000)
    assert k8s.container("gateway")["ports"][0]["containerPort"] == k8s_gateway.port


def test_compose_and_k8s_are_wired_alike(k8s, compose):
    services = compose["services"]
    workers = compose_services(compose)
    # compose: every pdserve service shares the kvstore's IPC namespace and names the same store
    store = parse("services.kvstore", workers["kvstore"][1]).store
    for name in WORKERS:
        assert services[name]["environment"]["PDSERVE_KVSTORE"] == store
        assert services[name]["ipc"] == "service:kvstore"

    k8s_env = k8s.configmap_data(k8s.container("gateway"))
    for key, scheme, port in (("PDSERVE_NATS_URL", "nats", 4222), ("PDSERVE_REDIS_URL", "redis", 6379)):
        for where, url in (("compose", services["gateway"]["environment"][key]), ("k8s", k8s_env[key])):
            parts = urlsplit(url)
            assert (parts.scheme, parts.port) == (scheme, port), f"{where} {key}={url}"
        assert urlsplit(services["gateway"]["environment"][key]).hostname in services  # a compose service
        assert k8s.get("Service", urlsplit(k8s_env[key]).hostname)  # a k8s Service

    # both: NATS runs JetStream and asks for the token, Valkey for the password, and every pdserve
    # service has both
    (volume,) = [v for v in pod(k8s.get("StatefulSet", "nats"))["volumes"] if "configMap" in v]
    nats_conf = k8s.get("ConfigMap", volume["configMap"]["name"])["data"]["nats.conf"]
    assert "-js" in services["nats"]["command"] and "--auth" in services["nats"]["command"]
    assert "jetstream" in nats_conf and "token: $PDSERVE_NATS_TOKEN" in nats_conf
    assert "--requirepass" in services["redis"]["command"]
    assert all("--requirepass" in pod(w)["containers"][0]["args"] for w in k8s.component("valkey"))
    for component in SERVICES:
        for where, env in (("compose", services[component]["environment"]), ("k8s", k8s.env(k8s.container(component)))):
            assert {"PDSERVE_NATS_TOKEN", "PDSERVE_REDIS_PASSWORD"} <= env.keys(), f"{where}: {component}"


def test_a_plan_is_written_as_an_overlay_that_deploys_it(tmp_path):
    """`pdserve plan --kustomize DIR`: an overlay over production that renders, with the pools at the
    plan's counts, its chunk budget and jobs a prefill worker in the workers' environment, and
    `pdserve planner` given the plan's SLOs, budget and what a worker carries (the forecast policy),
    flags its own parser and limits take."""
    import sys

    from services.cli import build_parser
    from services.planner.autoscale import limits_config

    if KUBECTL is None:
        pytest.skip("kubectl is not installed (make tools installs it): it renders the kustomize overlays")
    out = tmp_path / "plan-overlay"
    # the profile is named: the one shipped for this host's CPU may plan no configuration within the
    # budget (on the Zen 4's, chat's simulated TTFT p90 is 1.6-2.9 s), and this is about the overlay
    profile = ROOT / "shared/sim/profiles/cpu-smollm2-135m-amx.json"
    plan = subprocess.run([sys.executable, "-m", "services.cli", "plan", "--profile", str(profile),
                           "--workload", "chat", "--request-rate", "1",
                           "--duration", "30", "--budget", "4", "--modes", "disaggregated", "--chunk-budgets", "256",
                           "--prefill-inflights", "2", "--slo-ttft-p90-ms", "1500", "--slo-itl-p90-ms", "150",
                           "--kustomize", str(out), "--json", str(tmp_path / "plan.json")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert plan.returncode == 0, plan.stderr
    assert f"kubectl apply -k {out}" in plan.stdout
    rec = json.loads((tmp_path / "plan.json").read_text())["recommended"]
    rendered = subprocess.run([KUBECTL, "kustomize", str(out)], capture_output=True, text=True, timeout=60)
    assert rendered.returncode == 0, rendered.stderr
    m = Manifests("plan", [o for o in yaml.safe_load_all(rendered.stdout) if o])
    env = {kind: {e["name"]: e.get("value") for e in m.container(kind).get("env", [])} for kind in WORKERS}
    for kind in WORKERS:
        assert m.workload(kind)["spec"]["replicas"] == rec[kind]
        assert env[kind]["PDSERVE_MAX_NUM_BATCHED_TOKENS"] == "256"
    assert env["prefill"]["PDSERVE_MAX_INFLIGHT"] == "2"
    assert {e["name"]: e.get("value") for e in m.container("gateway")["env"]}["PDSERVE_MODE"] == "disaggregated"
    args = build_parser().parse_args(["planner", *m.container("planner", "planner")["args"]])
    config = limits_config(args)
    assert args.policy == "forecast" and args.capacity and config.budget == 4
    assert (config.slo_ttft_p90_s, config.slo_itl_p90_s) == (1.5, 0.15)
    assert config.bounds("prefill")[0] <= rec["prefill"] <= config.bounds("prefill")[1]


def test_a_colocated_plan_is_not_written_as_an_overlay():
    """The deploy files run separate prefill and decode pools: a colocated plan is refused with the
    reason (no kubectl needed to tell)."""
    from services.planner.kustomize import overlay

    colocated = {"recommended": {"mode": "colocated", "prefill": 0, "decode": 2}, "slo": {}, "budget": 4}
    with pytest.raises(ValueError, match="colocated plan is not written"):
        overlay(colocated)
