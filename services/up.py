"""`pdserve up`: the embedded default. Starts, on this machine, `nats-server -js` and `valkey-server`
(unless `--nats`/`--redis` name existing ones), the kvstore, the workers and the gateway, each a
child process running the same entry points docker-compose uses; waits until /health is green;
prints the URL. Then it supervises them: a child that dies is restarted with backoff (the embedded
servers too, on the same port and state); a child that keeps crashing right after it starts makes
`up` give up with that child's error (exit 1). Ctrl-C / SIGTERM stops everything in reverse order:
the gateway ends its open streams, the workers drain, then exit 0, no orphans.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from shared.cli_args import add_connection_args, add_speculative_args, env, speculative_argv
from services.supervisor import CrashLoop, RestartPolicy, Supervisor
from shared.transport.servers import ServerProcess, die_with_parent, start_nats, start_valkey, wait_for_http_ok

log = logging.getLogger("pdserve.up")

POLL_S = 0.2  # how often `up` looks for children that died
# stop order (highest first): the gateway ends its streams, then the workers drain, then the
# kvstore, then the servers everything talks through
STAGE_SERVERS, STAGE_KVSTORE, STAGE_WORKERS, STAGE_GATEWAY = 0, 1, 2, 3


def add_up_args(p: argparse.ArgumentParser) -> None:
    add_connection_args(p)
    p.set_defaults(nats=None, redis=None)  # none given: start our own
    p.add_argument("--host", default=env("PDSERVE_HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(env("PDSERVE_PORT", "8000")))
    p.add_argument("--mode", default=env("PDSERVE_MODE", "disaggregated"),
                   choices=["disaggregated", "colocated", "conditional"])
    p.add_argument("--prefill", type=int, default=1, help="prefill workers")
    p.add_argument("--decode", type=int, default=1, help="decode workers (colocated mode: engine workers)")
    p.add_argument("--model", default=env("PDSERVE_MODEL"))
    p.add_argument("--dtype", default=env("PDSERVE_DTYPE", "float32"), help="activations (see `pdserve decode --help`)")
    p.add_argument("--quantization", default=env("PDSERVE_QUANTIZATION", "auto"), choices=["auto", "none"])
    p.add_argument("--kv-dtype", default=env("PDSERVE_KV_DTYPE", "bfloat16"), help="KV cache and KV block dtype")
    p.add_argument("--device", default=env("PDSERVE_DEVICE", "cpu"),
                   help="every engine's device: cpu, or cuda (dense weights in --dtype, e.g. bfloat16; all "
                        "engines share the one GPU)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per engine worker (default: the cores divided among them); an idle "
                        "worker lends its threads to the busy ones")
    p.add_argument("--no-core-share", action="store_true",
                   help="each worker keeps to its own --threads, even while the others are idle")
    add_speculative_args(p)
    p.add_argument("--api-key", default=env("PDSERVE_API_KEY"))
    p.add_argument("--price", default=env("PDSERVE_PRICE", ""), metavar="prefill=P,decode=D,gb=G,currency=C",
                   help="what a second of prefill, a second of decode and a GB of KV moved cost: each response's "
                        "usage.cost and pdserve_cost_total then carry money, not only seconds and bytes")
    p.add_argument("--kv-network", action="store_true", help="move KV over NATS instead of shared memory")
    p.add_argument("--kv-slots", type=int, default=1024, help="kvstore blocks (bf16: 360 KiB each)")
    p.add_argument("--workdir", default=None, help="logs and server state (default: a temp dir)")
    p.add_argument("--worker-arg", action="append", default=[], help="extra argument for every worker")
    p.add_argument("--gateway-arg", action="append", default=[], help="extra argument for the gateway")


class Stack:
    """The child processes of one `pdserve up`, supervised (`services/supervisor.py`): started in
    order, restarted when one dies, stopped stage by stage (gateway, workers, kvstore, servers)."""

    def __init__(self, workdir: Path, policy: RestartPolicy | None = None):
        self.workdir = workdir
        self.servers: list[ServerProcess] = []
        self.supervisor = Supervisor(policy)

    def spawn(self, name: str, module: str, args: list[str], extra_env: dict[str, str] | None = None,
              stage: int = STAGE_WORKERS) -> None:
        log_path = self.workdir / f"{name}.log"
        env_vars = os.environ | (extra_env or {})

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
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="pdserve-up-"))
    workdir.mkdir(parents=True, exist_ok=True)
    stack = Stack(workdir)
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
    if nats_url is None:
        server = start_nats(workdir=stack.workdir / "nats", user=args.nats_user, password=args.nats_password,
                            token=args.nats_token)
        stack.add_server(server)
        nats_url = server.url
    if redis_url is None:
        server = start_valkey(workdir=stack.workdir / "valkey", password=args.redis_password)
        stack.add_server(server)
        redis_url = server.url
    auth = []
    for flag, value in (("--nats-user", args.nats_user), ("--nats-password", args.nats_password),
                        ("--nats-token", args.nats_token), ("--redis-password", args.redis_password)):
        if value:
            auth += [flag, value]
    conn = ["--nats", nats_url, "--redis", redis_url, *auth]
    if args.otlp_endpoint:  # every service traces, and exports to the same collector
        conn += ["--otlp-endpoint", args.otlp_endpoint, "--trace-sample-ratio", str(args.trace_sample_ratio)]
    store = f"kv-up-{os.getpid()}"
    model_args = ["--model", model, "--dtype", args.dtype, "--quantization", args.quantization,
                  "--kv-dtype", args.kv_dtype, "--device", args.device, *speculative_argv(args)]
    colocated = args.mode == "colocated"
    n_engines = args.decode + (0 if colocated else args.prefill)
    threads = args.threads or max(1, (os.cpu_count() or 1) // max(1, n_engines))
    worker = conn + model_args + ["--kvstore", store, "--threads", str(threads)] + args.worker_arg
    if args.kv_network:
        worker.append("--kv-network")
    slots = iter(range(n_engines))

    def share() -> list[str]:  # each engine lends its cores to the others while it is idle
        return [] if args.no_core_share else ["--core-share", str(stack.workdir / "cores"), "--core-slot",
                                              str(next(slots))]

    if not colocated:
        stack.spawn("kvstore", "services.kvstore",
                    [*conn, "--model", model, "--dtype", args.kv_dtype, "--store", store,
                     "--num-slots", str(args.kv_slots)],
                    stage=STAGE_KVSTORE)
        for i in range(args.prefill):
            stack.spawn(f"prefill-{i}", "services.prefill", worker + ["--instance", f"prefill-{i}", *share()],
                        stage=STAGE_WORKERS)
    for i in range(args.decode):
        role = "colocated" if colocated else "decode"
        stack.spawn(f"{role}-{i}", "services.decode",
                    worker + ["--role", role, "--instance", f"{role}-{i}", *share()], stage=STAGE_WORKERS)
    expect = {"colocated": args.decode} if colocated else {"prefill": args.prefill, "decode": args.decode, "kvstore": 1}
    gateway = conn + ["--model", model, "--host", args.host, "--port", str(args.port), "--mode", args.mode,
                      "--expect", ",".join(f"{role}={n}" for role, n in expect.items())]
    if args.api_key:
        gateway += ["--api-key", args.api_key]
    if args.price:
        gateway += ["--price", args.price]
    gateway += args.gateway_arg
    stack.spawn("gateway", "services.gateway", gateway, stage=STAGE_GATEWAY)


def _build_cpu_extension(args: argparse.Namespace) -> None:
    """Build (or load from its cache) the CPU kernels once, before the workers start, and say what
    a cold start cost: the workers then load it in milliseconds instead of racing to build it."""
    if args.quantization != "auto" or args.device != "cpu":
        return
    from shared.kernels import cpu_ext

    if cpu_ext.load() is not None and cpu_ext.BUILD_SECONDS is not None:
        log.info("cold start: compiled pdserve's CPU kernels in %.0f s (cached for later starts)", cpu_ext.BUILD_SECONDS)


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

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    stack = None
    try:
        stack, url = start_stack(args)
        wait_healthy(stack, url)
        print(f"pdserve is up ({args.mode}): {url}   logs: {stack.workdir}", flush=True)
        print(f"""try:  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{{"model": "SmolLM2-135M-Instruct", "messages": [{{"role": "user", "content": "What is the capital of France?"}}], "stream": true}}'""",
              flush=True)
        orderly = True
        while not stopping.wait(POLL_S):
            stack.check_alive()
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
