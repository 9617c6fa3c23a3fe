"""`pdserve up`: the embedded default. Starts, on this machine, `nats-server -js` and `valkey-server`
(unless `--nats`/`--redis` name existing ones), the kvstore, the workers and the gateway, each a
child process running the same entry points docker-compose uses; waits until /health is green;
prints the URL. Then it supervises them: a child that dies is restarted with backoff (the embedded
servers too, on the same port and state); a child that keeps crashing right after it starts makes
`up` give up with that child's error (exit 1). Ctrl-C / SIGTERM stops everything in reverse order:
the gateway ends its open streams, the workers drain, then exit 0, no orphans.

Settings resolve as: an explicit flag > the `--plan` (a `pdserve plan --json` result: its recommended
mode, pools, chunk budget and jobs a prefill worker) > the `--preset` (services/presets.py) > today's
default, and `up` prints each with where it came from; `--dry-run` prints them and every child's
command line, and starts nothing. `--hosts N` plays N hosts on this machine: a kvstore per host,
the workers spread over them round-robin. `--autoscale` adds and removes local workers within
limits from the gateway's metrics (services/planner/autoscale.py), through the same supervisor.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from shared.cli_args import add_connection_args, add_speculative_args, add_worker_args, env, speculative_argv
from services.gateway.config import MODES, ROUTERS
from services.presets import PRESETS
from services.planner.autoscale import add_autoscale_args, autoscale_config, forecast_scaler, start_autoscaler
from services.supervisor import CrashLoop, RestartPolicy, Supervisor
from shared.engine.cores import SLOTS as CORE_SLOTS
from shared.transport.servers import (
    ServerProcess, cluster_url, die_with_parent, reserve_port, sentinel_url, start_nats, start_nats_cluster,
    start_valkey, start_valkey_ha, wait_for_http_ok,
)

log = logging.getLogger("pdserve.up")

POLL_S = 0.2  # how often `up` looks for children that died
# stop order (highest first): the gateway ends its streams, then the workers drain, then the
# kvstore, then the servers everything talks through
STAGE_SERVERS, STAGE_KVSTORE, STAGE_WORKERS, STAGE_GATEWAY = 0, 1, 2, 3


def add_up_args(p: argparse.ArgumentParser) -> None:
    add_connection_args(p)
    p.set_defaults(nats=None, redis=None)  # none given: start our own
    p.add_argument("--nats-cluster", type=int, default=1, metavar="N",
                   help="start N nats-server nodes as one JetStream cluster (work queues replicated 3 ways from "
                        "N = 3: a job survives losing a node) instead of one server")
    p.add_argument("--valkey-ha", action="store_true",
                   help="start a Valkey primary, a replica and 3 sentinels instead of one server: the services "
                        "follow a failover to the replica")
    p.add_argument("--host", default=env("PDSERVE_HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(env("PDSERVE_PORT", "8000")))
    # None below: "not given", resolved after parsing (`resolve_settings`): flag > --plan > --preset > default
    p.add_argument("--preset", default=None, choices=sorted(PRESETS),
                   help="a scenario's bundle of settings (services/presets.py); explicit flags win over it")
    p.add_argument("--plan", default=None, metavar="PLAN.json",
                   help="deploy a `pdserve plan --json` result: its recommended mode, pools, chunk budget and jobs a "
                        "prefill worker (a forecast plan's: its busiest period's); flags win over it, it over --preset")
    p.add_argument("--dry-run", action="store_true",
                   help="print the resolved settings and every child's command line, start nothing")
    p.add_argument("--mode", default=None, choices=MODES,
                   help="default: $PDSERVE_MODE, else disaggregated")
    p.add_argument("--prefill", type=int, default=None, help="prefill workers (default 1)")
    p.add_argument("--decode", type=int, default=None,
                   help="decode workers (colocated mode: engine workers) (default 1)")
    p.add_argument("--hosts", type=int, default=None,
                   help="play N hosts on this machine: a kvstore each, the workers spread over them (default 1)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="every engine's tokens per step: the chunked-prefill budget (default: the worker's)")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="every engine's running sequences per step (default: the worker's)")
    p.add_argument("--max-inflight", type=int, default=None,
                   help="jobs a prefill worker takes at once; the rest wait in the queue (default: the worker's)")
    p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="the engines' prefix cache (default: on)")
    p.add_argument("--chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="the engines' chunked prefill (default: on)")
    p.add_argument("--router", default=None, choices=ROUTERS,
                   help="the gateway's choice of worker (default: the gateway's, cache-aware)")
    p.add_argument("--hot-spot-factor", type=float, default=None, help="the gateway's cache-aware hot-spot guard")
    p.add_argument("--conditional-threshold", type=int, default=None, help="the gateway's (conditional mode)")
    p.add_argument("--conditional-busy-threshold", type=int, default=None, help="the gateway's (conditional mode)")
    p.add_argument("--conditional-queue-tokens", type=int, default=None, help="the gateway's (conditional mode)")
    p.add_argument("--model", default=env("PDSERVE_MODEL"))
    p.add_argument("--dtype", default=env("PDSERVE_DTYPE", "float32"), help="activations (see `pdserve decode --help`)")
    p.add_argument("--quantization", default=env("PDSERVE_QUANTIZATION", "auto"), choices=["auto", "none"])
    p.add_argument("--kv-dtype", default=env("PDSERVE_KV_DTYPE", "bfloat16"), help="KV cache and KV block dtype")
    p.add_argument("--device", default=env("PDSERVE_DEVICE", "cpu"),
                   help="every engine's device: cpu, or cuda (dense weights in --dtype, e.g. bfloat16; all "
                        "engines share the one GPU)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per engine worker (default: the cores divided among the workers present, "
                        "as the autoscaler adds and drains them); an idle worker lends its threads to the busy ones")
    p.add_argument("--no-core-share", action="store_true",
                   help="each worker keeps to its own --threads, even while the others are idle")
    add_speculative_args(p)
    p.set_defaults(speculative=None)  # resolved like the others: flag > preset > $PDSERVE_SPECULATIVE or suffix
    p.add_argument("--api-key", default=env("PDSERVE_API_KEY"))
    p.add_argument("--price", default=env("PDSERVE_PRICE", ""), metavar="prefill=P,decode=D,gb=G,currency=C",
                   help="what a second of prefill, a second of decode and a GB of KV moved cost: each response's "
                        "usage.cost and pdserve_cost_total then carry money, not only seconds and bytes")
    p.add_argument("--kv-network", action="store_true", help="move KV over NATS instead of shared memory")
    p.add_argument("--kv-slots", type=int, default=1024, help="kvstore blocks (bf16: 360 KiB each)")
    p.add_argument("--workdir", default=None, help="logs and server state (default: a temp dir)")
    p.add_argument("--worker-arg", action="append", default=[], help="extra argument for every worker")
    p.add_argument("--gateway-arg", action="append", default=[], help="extra argument for the gateway")
    add_autoscale_args(p)


# ------------------------------------------------------------------------------- settings

# What `resolve_settings` fills in, in the order `up` prints them. The engine settings reach every
# worker as worker arguments, the routing ones the gateway as gateway arguments; a setting left at
# its default is not passed on (the child's own default, environment included, is today's).
SETTINGS = ("mode", "prefill", "decode", "hosts", "max_num_batched_tokens", "prefix_caching", "chunked_prefill",
            "speculative", "max_num_seqs", "max_inflight", "router", "hot_spot_factor", "conditional_threshold",
            "conditional_busy_threshold", "conditional_queue_tokens")
ENGINE_VALUES = ("max_num_batched_tokens", "max_num_seqs", "max_inflight")  # passed as --flag VALUE
ENGINE_SWITCHES = ("prefix_caching", "chunked_prefill")  # passed as --no-flag when off
GATEWAY_VALUES = ("router", "hot_spot_factor", "conditional_threshold", "conditional_busy_threshold",
                  "conditional_queue_tokens")


@dataclass(frozen=True)
class Setting:
    """One resolved `up` option and where its value came from."""

    name: str  # the argparse dest
    value: object
    source: str  # "flag", "plan FILE", "preset NAME" or "default"

    @property
    def given(self) -> bool:
        return self.source != "default"

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def default_settings() -> dict[str, object]:
    """Today's value of each setting when neither a flag nor a preset sets it: `up`'s own, and for
    what `up` does not pass on, the worker's and the gateway's own defaults (their env included)."""
    from services.gateway.__main__ import build_parser as gateway_parser

    engine = argparse.ArgumentParser(add_help=False)
    add_worker_args(engine)
    gateway = gateway_parser()
    return {"mode": env("PDSERVE_MODE", "disaggregated"), "prefill": 1, "decode": 1, "hosts": 1,
            "prefix_caching": not engine.get_default("no_prefix_caching"),
            "chunked_prefill": not engine.get_default("no_chunked_prefill"),
            **{name: engine.get_default(name) for name in (*ENGINE_VALUES, "speculative")},
            **{name: gateway.get_default(name) for name in GATEWAY_VALUES}}


def resolve_settings(args: argparse.Namespace) -> argparse.Namespace:
    """A copy of `args` with every setting filled in (explicit flag > plan > preset > default) and
    `settings`, the resolved Settings in print order. Idempotent: a resolved copy comes back as is."""
    if hasattr(args, "settings"):
        return args
    preset = PRESETS[args.preset] if getattr(args, "preset", None) else None
    from_preset = preset.settings() if preset else {}
    from_plan = plan_settings(args.plan) if getattr(args, "plan", None) else {}
    defaults = default_settings()
    resolved = argparse.Namespace(**vars(args))
    settings = []
    for name in SETTINGS:
        if getattr(args, name, None) is not None:
            setting = Setting(name, getattr(args, name), "flag")
        elif name in from_plan:
            setting = Setting(name, from_plan[name], f"plan {Path(args.plan).name}")
        elif name in from_preset:
            setting = Setting(name, from_preset[name], f"preset {preset.name}")
        else:
            setting = Setting(name, defaults[name], "default")
        setattr(resolved, name, setting.value)
        settings.append(setting)
    for name in ("slo_ttft_p90_ms", "slo_itl_p90_ms"):  # (`--autoscale`'s; not printed among the settings)
        if getattr(resolved, name, 0) is None and name in from_plan:
            setattr(resolved, name, from_plan[name])
    for name, least in (("prefill", 0), ("decode", 1), ("hosts", 1)):
        if getattr(resolved, name) < least:
            raise ValueError(f"--{name} must be at least {least}, got {getattr(resolved, name)}")
    resolved.settings = tuple(settings)
    return resolved


def plan_settings(path: str) -> dict[str, object]:
    """The settings of a `pdserve plan --json` result's recommended configuration, and the SLOs it
    was planned for (ValueError: a file that is not one, a plan that found none, or one `up` cannot
    run)."""
    import json

    from services.planner.plan import deployment

    try:
        plan = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--plan {path}: cannot read it as a plan ({exc})") from None
    if not isinstance(plan, dict) or not isinstance(plan.get("recommended", 0), dict | None):
        raise ValueError(f"--plan {path}: not the JSON of `pdserve plan --json` (no recommended configuration)")
    if plan["recommended"] is None:
        raise ValueError(f"--plan {path}: the plan found no configuration that meets its SLOs within its budget; "
                         "there is nothing to deploy")
    try:
        settings = deployment(plan["recommended"])
    except KeyError as exc:
        raise ValueError(f"--plan {path}: its recommended configuration lacks {exc}") from None
    except TypeError as exc:
        raise ValueError(f"--plan {path}: its recommended configuration is malformed ({exc})") from None
    except ValueError as exc:
        raise ValueError(f"--plan {path}: {exc}") from None
    slo = plan.get("slo")  # what the plan was made for: the autoscaler's SLOs, unless given
    if isinstance(slo, dict):
        settings |= {f"slo_{k}": float(v) for k, v in slo.items() if k in ("ttft_p90_ms", "itl_p90_ms")
                     and isinstance(v, int | float)}
    return settings


def format_settings(args: argparse.Namespace) -> str:
    """One line per setting: flag, value, where it came from (the extra worker/gateway args too)."""
    preset = f" (preset {args.preset}: {PRESETS[args.preset].summary})" if args.preset else ""
    lines = [f"pdserve up settings{preset}:"]
    for s in args.settings:
        value = ("on" if s.value else "off") if isinstance(s.value, bool) else s.value
        lines.append(f"  {s.flag:<30} {value!s:<14} [{s.source}]")
    for flag, extra in (("--worker-arg", args.worker_arg), ("--gateway-arg", args.gateway_arg)):
        for arg in extra:  # appended last: they win over the settings above
            lines.append(f"  {flag:<30} {arg:<14} [flag]")
    return "\n".join(lines)


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine settings a flag or the preset gave, as worker arguments."""
    argv = []
    for s in args.settings:
        if s.given and s.name in ENGINE_VALUES:
            argv += [s.flag, str(s.value)]
        elif s.given and s.name in ENGINE_SWITCHES and not s.value:
            argv.append("--no-" + s.flag[2:])
    return argv


def gateway_argv(args: argparse.Namespace) -> list[str]:
    """The routing settings a flag or the preset gave, as gateway arguments."""
    return [arg for s in args.settings if s.given and s.name in GATEWAY_VALUES for arg in (s.flag, str(s.value))]


class Stack:
    """The child processes of one `pdserve up`, supervised (`services/supervisor.py`): started in
    order, restarted when one dies, stopped stage by stage (gateway, workers, kvstore, servers)."""

    def __init__(self, workdir: Path, policy: RestartPolicy | None = None):
        self.workdir = workdir
        self.servers: list[ServerProcess] = []
        self.supervisor = Supervisor(policy)
        self.recipe: WorkerRecipe | None = None  # how its workers are started (set by _start)
        self.env: dict[str, str] = {}  # added to every child's environment

    def spawn(self, name: str, module: str, args: list[str], extra_env: dict[str, str] | None = None,
              stage: int = STAGE_WORKERS) -> None:
        log_path = self.workdir / f"{name}.log"
        env_vars = os.environ | self.env | (extra_env or {})

        def start() -> subprocess.Popen:
            with open(log_path, "ab") as log_file:  # the child keeps its own descriptor
                return subprocess.Popen([sys.executable, "-m", module, *args], stdout=log_file,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env_vars,
                                        preexec_fn=die_with_parent,
                                        start_new_session=True)  # Ctrl-C reaches `up` only; it stops them in order

        self.supervisor.start(name, start, log_path, stage)

    def add_server(self, server: ServerProcess) -> None:
        """Supervise an embedded server: restarted on the same port with the same state directory."""
        self.servers.append(server)
        self.supervisor.adopt(server.name, server.proc, server.respawn, server.workdir / f"{server.name}.log",
                              stage=STAGE_SERVERS)

    @property
    def procs(self) -> list[tuple[str, subprocess.Popen]]:
        """(name, process) of each service (not the embedded servers: `servers`), in start order."""
        servers = {server.name for server in self.servers}
        return [(child.name, child.proc) for child in self.supervisor.children if child.name not in servers]

    def process(self, name: str) -> subprocess.Popen:
        return self.supervisor.child(name).proc

    def check_alive(self) -> None:
        """Restart children that died; raises CrashLoop when one will not stay up."""
        self.supervisor.poll()

    def stop(self, timeout: float = 15.0) -> None:
        self.supervisor.stop(timeout)
        for server in self.servers:  # a test may have restarted one by hand, outside the supervisor
            server.stop()


def start_stack(args: argparse.Namespace) -> tuple[Stack, str]:
    args = resolve_settings(args)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="pdserve-up-"))
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "cores").unlink(missing_ok=True)  # a reused workdir: no slots of an earlier stack's workers
    stack = Stack(workdir)
    reserve_port(args.port)  # the gateway binds it last: no embedded server may take it first
    try:
        _start(stack, args)
    except BaseException:
        stack.stop()
        raise
    return stack, f"http://{args.host}:{args.port}"


def _start(stack: Stack, args: argparse.Namespace) -> None:
    from shared.model.hub import resolve_model_path

    model = str(resolve_model_path(args.model))  # pull the default model once, before the children start
    _build_cpu_extension(args)
    nats_url, redis_url = args.nats, args.redis
    if nats_url is None and args.nats_cluster > 1:
        nodes = start_nats_cluster(args.nats_cluster, stack.workdir / "nats", user=args.nats_user,
                                   password=args.nats_password, token=args.nats_token)
        for node in nodes:
            stack.add_server(node)
        nats_url = cluster_url(nodes)
        # every service creates the work queues this replicated (unless the environment says otherwise)
        stack.env["PDSERVE_STREAM_REPLICAS"] = os.environ.get("PDSERVE_STREAM_REPLICAS", str(min(3, args.nats_cluster)))
    elif nats_url is None:
        server = start_nats(workdir=stack.workdir / "nats", user=args.nats_user, password=args.nats_password,
                            token=args.nats_token)
        stack.add_server(server)
        nats_url = server.url
    if redis_url is None and args.valkey_ha:
        servers = start_valkey_ha(stack.workdir / "valkey", password=args.redis_password)
        for server in servers:
            stack.add_server(server)
        redis_url = sentinel_url(servers[2:])
    elif redis_url is None:
        server = start_valkey(workdir=stack.workdir / "valkey", password=args.redis_password)
        stack.add_server(server)
        redis_url = server.url
    stack.recipe = WorkerRecipe(args, model, connection_argv(args, nats_url, redis_url), stack.workdir)
    for child in plan_children(args, stack.recipe):
        stack.spawn(child.name, child.module, child.args, stage=child.stage)


@dataclass(frozen=True)
class ChildSpec:
    """One service process `up` starts: supervised under `name`, stopped at `stage`."""

    name: str
    module: str
    args: list[str]
    stage: int

    def argv(self) -> list[str]:
        return [sys.executable, "-m", self.module, *self.args]


def connection_argv(args: argparse.Namespace, nats_url: str, redis_url: str) -> list[str]:
    """Where NATS and Valkey are, and how to log in: the first arguments of every service."""
    auth = []
    for flag, value in (("--nats-user", args.nats_user), ("--nats-password", args.nats_password),
                        ("--nats-token", args.nats_token), ("--redis-password", args.redis_password)):
        if value:
            auth += [flag, value]
    conn = ["--nats", nats_url, "--redis", redis_url, *auth]
    if args.otlp_endpoint:  # every service traces, and exports to the same collector
        conn += ["--otlp-endpoint", args.otlp_endpoint, "--trace-sample-ratio", str(args.trace_sample_ratio)]
    return conn


def store_names(hosts: int, pid: int) -> list[str]:
    """One kvstore per (played) host; a single host keeps the plain name."""
    return [f"kv-up-{pid}"] if hosts == 1 else [f"kv-up-{pid}-h{i}" for i in range(hosts)]


class WorkerRecipe:
    """The command line of worker i of a role, for `up`'s own workers and the autoscaler's: on
    played host i % hosts with that host's kvstore, its share of the cores (the cores divided among
    the engines present: `up`'s to begin with, then as the autoscaler adds and drains) and a
    core-share slot of its own."""

    def __init__(self, args: argparse.Namespace, model: str, conn: list[str], workdir: Path):
        self.args, self.model, self._conn, self.workdir = args, model, conn, workdir
        self.colocated = args.mode == "colocated"
        self.stores = store_names(args.hosts, os.getpid())
        self.model_args = ["--model", model, "--dtype", args.dtype, "--quantization", args.quantization,
                           "--kv-dtype", args.kv_dtype, "--device", args.device, *speculative_argv(args),
                           *engine_argv(args)]
        n_engines = args.decode + (0 if self.colocated else args.prefill)
        self.threads = args.threads or max(1, (os.cpu_count() or 1) // max(1, n_engines))

    def conn(self, k: int = 0) -> list[str]:
        """The connection arguments, a NATS URL list rotated by `k`: clients keep the list's order
        (nats_bus.connect), so the children of a --nats-cluster spread over its nodes instead of all
        connecting to the first (and all reconnecting at once when it goes)."""
        argv = list(self._conn)
        urls = argv[argv.index("--nats") + 1].split(",")
        k %= len(urls)
        argv[argv.index("--nats") + 1] = ",".join(urls[k:] + urls[:k])
        return argv

    def slot(self, role: str, i: int) -> int:
        """Unique per worker name: prefill i → 2i, decode i → 2i + 1 (colocated i → i)."""
        return i if self.colocated else 2 * i + (role != "prefill")

    def child(self, role: str, i: int) -> ChildSpec:
        name, args = f"{role}-{i}", self.args
        argv = (self.conn(self.slot(role, i)) + self.model_args + ["--kvstore", self.stores[i % len(self.stores)],
                                               "--threads", str(self.threads)] + args.worker_arg)
        if args.kv_network:
            argv.append("--kv-network")
        if not args.no_core_share and self.slot(role, i) < CORE_SLOTS:  # idle engines lend each other their cores
            argv += ["--core-share", str(self.workdir / "cores"), "--core-slot", str(self.slot(role, i))]
            if not args.threads:  # … and divide the host among those present, as the autoscaler adds and drains
                argv.append("--fair-share")
        if role == "prefill":
            return ChildSpec(name, "services.prefill", argv + ["--instance", name], STAGE_WORKERS)
        return ChildSpec(name, "services.decode", argv + ["--role", role, "--instance", name], STAGE_WORKERS)


class StackWorkers:
    """The autoscaler's hands (services/planner/autoscale.py's Actuator) on `up`'s own stack: a new
    worker is started by the recipe under the supervisor (restarted if it dies, like the others),
    with the smallest free index of its role; a removed one is retired (SIGTERM: it drains, exits,
    and is forgotten)."""

    def __init__(self, stack: Stack):
        self.stack = stack

    def role(self, kind: str) -> str:
        return "colocated" if kind == "decode" and self.stack.recipe.colocated else kind

    def running(self) -> dict[str, list[str]]:
        return {kind: [c.name for c in self.stack.supervisor.children if c.name.startswith(f"{self.role(kind)}-")]
                for kind in ("prefill", "decode")}

    def spawn(self, kind: str) -> str:
        role = self.role(kind)
        i = next(i for i in itertools.count() if not self.stack.supervisor.has(f"{role}-{i}"))
        child = self.stack.recipe.child(role, i)
        self.stack.spawn(child.name, child.module, child.args, stage=child.stage)
        return child.name

    def drain(self, kind: str, name: str, load: dict[str, float] | None = None) -> None:
        self.stack.supervisor.retire(name)  # named by the policy: the least loaded

    def exited(self, name: str) -> bool:
        return not self.stack.supervisor.has(name)


def plan_children(args: argparse.Namespace, recipe: WorkerRecipe) -> list[ChildSpec]:
    """The services of a resolved `args`, in start order: kvstores, prefill, decode, gateway.
    Worker i of each role sits on host i % hosts and uses that host's kvstore:

        hosts=2   kv-…-h0: prefill-0 decode-0 prefill-2 …   kv-…-h1: prefill-1 decode-1 …
    """
    model = recipe.model
    children = []
    if not recipe.colocated:
        for h, store in enumerate(recipe.stores):
            children.append(ChildSpec("kvstore" if len(recipe.stores) == 1 else f"kvstore-h{h}", "services.kvstore",
                                      [*recipe.conn(h), "--model", model, "--dtype", args.kv_dtype, "--store", store,
                                       "--num-slots", str(args.kv_slots)], STAGE_KVSTORE))
        children += [recipe.child("prefill", i) for i in range(args.prefill)]
    role = "colocated" if recipe.colocated else "decode"
    children += [recipe.child(role, i) for i in range(args.decode)]
    expect = ({"colocated": args.decode} if recipe.colocated else
              {"prefill": args.prefill, "decode": args.decode, "kvstore": len(recipe.stores)})
    gateway = recipe.conn() + ["--model", model, "--host", args.host, "--port", str(args.port), "--mode", args.mode,
                      "--expect", ",".join(f"{role}={n}" for role, n in expect.items())]
    if args.api_key:
        gateway += ["--api-key", args.api_key]
    if args.price:
        gateway += ["--price", args.price]
    gateway += gateway_argv(args) + args.gateway_arg
    children.append(ChildSpec("gateway", "services.gateway", gateway, STAGE_GATEWAY))
    return children


def format_plan(args: argparse.Namespace) -> str:
    """What `up` would start (--dry-run): the embedded servers (their ports are picked at start),
    then each service's exact command line. The default model is not pulled for this."""
    from shared.model.hub import DEFAULT_MODEL_ID, default_model_path, resolve_model_path

    workdir = Path(args.workdir or os.path.join(tempfile.gettempdir(), "pdserve-up-XXXXXXXX"))
    default = args.model in (None, DEFAULT_MODEL_ID, "default")
    model = default_model_path() if default else resolve_model_path(args.model)
    lines = ["pdserve up would start:"]
    if args.nats is None and args.nats_cluster > 1:
        for i in range(args.nats_cluster):
            lines.append(f"  {f'nats-{i}':<12} nats-server -js --cluster_name pdserve on free client and route ports "
                         f"(NATS_PORT_{i}), state in {workdir / 'nats' / f'nats-{i}'}")
        lines.append(f"  {'':<12} work queues replicated {min(3, args.nats_cluster)} ways; services get every node's URL")
    elif args.nats is None:
        lines.append(f"  {'nats':<12} nats-server -js on a free port (NATS_PORT), state in {workdir / 'nats'}")
    if args.redis is None and args.valkey_ha:
        lines.append(f"  {'valkey-0':<12} valkey-server, the primary (VALKEY_PORT_0)")
        lines.append(f"  {'valkey-1':<12} valkey-server --replicaof 127.0.0.1 VALKEY_PORT_0")
        for i in range(3):
            lines.append(f"  {f'sentinel-{i}':<12} valkey-server --sentinel on SENTINEL_PORT_{i}, monitoring the "
                         "primary as 'pdserve' (quorum 2, down after 1 s)")
    elif args.redis is None:
        lines.append(f"  {'valkey':<12} valkey-server on a free port (VALKEY_PORT), state in {workdir / 'valkey'}")
    nats = args.nats or (",".join(f"nats://127.0.0.1:NATS_PORT_{i}" for i in range(args.nats_cluster))
                         if args.nats_cluster > 1 else "nats://127.0.0.1:NATS_PORT")
    redis = args.redis or ("redis+sentinel://" + ",".join(f"127.0.0.1:SENTINEL_PORT_{i}" for i in range(3)) + "/pdserve"
                           if args.valkey_ha else "redis://127.0.0.1:VALKEY_PORT")
    conn = connection_argv(args, nats, redis)
    for child in plan_children(args, WorkerRecipe(args, str(model), conn, workdir)):
        lines.append(f"  {child.name:<12} {shlex.join(child.argv())}")
    return "\n".join(lines)


def _build_cpu_extension(args: argparse.Namespace) -> None:
    """Build the CPU kernels once, before the workers start, where they are not in the cache: the
    workers then load them in milliseconds instead of racing to build them. In a child process, so
    that this supervisor, which lives as long as the stack, never imports torch (~250 MB). The
    child's log (a first build's "compiling …, ~1 min") goes straight to the terminal."""
    from shared.kernels import cpu_ext

    if args.quantization != "auto" or args.device != "cpu" or cpu_ext.is_built():
        return
    done = subprocess.run([sys.executable, "-m", "shared.kernels.cpu_ext"], stdout=subprocess.PIPE, text=True)
    built = re.search(r"built in (\d+) s", done.stdout)
    if built:
        log.info("cold start: compiled pdserve's CPU kernels in %s s (cached for later starts)", built[1])
    elif done.returncode != 0 or "ready" not in done.stdout:  # the workers will say why, and run the torch path
        log.warning("the CPU kernels are not ready: %s", done.stdout.strip() or f"exit code {done.returncode}")


def wait_healthy(stack: Stack, url: str, timeout: float = 180.0) -> None:
    try:
        wait_for_http_ok(f"{url}/health", timeout, stack.check_alive)
    except TimeoutError:
        raise TimeoutError(f"pdserve did not become healthy within {timeout:.0f} s (logs in {stack.workdir})") from None


def cmd_up(args: argparse.Namespace) -> int:
    """Start the stack, then supervise it until Ctrl-C / SIGTERM (exit 0) or until a child keeps
    crashing (exit 1, with that child's error)."""
    stopping = threading.Event()
    orderly = False  # serving or stopping: a signal sets `stopping` and interrupts nothing

    def on_signal(signum, frame):  # SIGTERM behaves like Ctrl-C: stop everything in order
        stopping.set()
        if not orderly:  # still starting: break out of whatever start-up is waiting on
            raise KeyboardInterrupt

    args = resolve_settings(args)
    print(format_settings(args), flush=True)
    config = forecast = None
    if args.autoscale:
        try:
            config = autoscale_config(args)
        except ValueError as exc:
            print(f"pdserve up: error: {exc}", file=sys.stderr, flush=True)
            return 2
        print(config.describe(), flush=True)
        if args.policy == "forecast":  # a bad flag is one line now, not after the stack has started
            forecast = forecast_scaler(args, config, "pdserve up")
            print(f"  policy: {forecast.describe()}", flush=True)
    if args.dry_run:
        print(format_plan(args), flush=True)
        return 0
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    stack = None
    try:
        stack, url = start_stack(args)
        wait_healthy(stack, url)
        print(f"pdserve is up ({args.mode}): {url}   logs: {stack.workdir}", flush=True)
        print(f"""try:  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{{"model": "SmolLM2-135M-Instruct", "messages": [{{"role": "user", "content": "What is the capital of France?"}}], "temperature": 0, "stream": true}}'""",
              flush=True)
        orderly = True
        workers = StackWorkers(stack)
        autoscaler = start_autoscaler(config, forecast, url, workers, workers.running()) if args.autoscale else None
        while not stopping.wait(POLL_S):
            stack.check_alive()
            if autoscaler is not None:
                autoscaler.tick()
        print("stopping pdserve ...", flush=True)
        return 0
    except KeyboardInterrupt:
        print("stopping pdserve ...", flush=True)
        return 0
    except CrashLoop as exc:
        # the gateway is stopped first (below): it ends every open stream with an error event
        log.error("pdserve gives up: %s keeps crashing; stopping everything", exc.name)
        print(f"pdserve: error: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        orderly = True  # the ordered stop runs to its end (each stage is bounded)
        if stack is not None:
            stack.stop()
