"""Several "hosts" on one machine: Linux network namespaces on a private bridge.

    root ns (the test) ── veth ──┐
    host 0: lo + 10.S.0.1 ── veth ┤ bridge (in a namespace of its own)
    host 1: lo + 10.S.0.2 ── veth ┤
    host 2: lo + 10.S.0.3 ── veth ┘

Each host has its own loopback and address, so every host runs its services on the same ports
(NATS 4222/6222, the gateway 8000) as separate machines would; traffic between them crosses only
these private test links. `partition(i)` takes host i's link down (`heal(i)` brings it back); the
kernel here has no netem, so latency is added by `DelayProxy`, a TCP proxy of our own.

Needs root and `ip` (iproute2; `make tools` installs it). Processes run in a host with
`ip netns exec`; `close()` stops them and removes every namespace and link it made.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from shared.transport.servers import (
    die_with_parent,
    nats_cluster_conf,
    nats_server_binary,
    valkey_server_binary,
    wait_for_port,
)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def cannot_play_hosts() -> str | None:
    """Why this machine cannot make network namespaces (no `ip`, not permitted), or None."""
    if shutil.which("ip") is None:
        return "needs `ip` (iproute2; make tools installs it)"
    probe = f"pdprobe{os.getpid() % 100000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        if "denied" in made.stderr.lower() or "not permitted" in made.stderr.lower():
            return f"network namespaces are not permitted here: {made.stderr.strip()}"
        raise RuntimeError(f"ip netns add failed: {made.stderr.strip()}")
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


class PlayedHosts:
    def __init__(self, n: int, workdir: Path):
        self.n, self.workdir = n, workdir
        tag = f"pd{os.getpid() % 100000}"
        self.tag, self.subnet = tag, f"10.{100 + os.getpid() % 100}.0"
        self.switch = f"{tag}sw"
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self._made: list[str] = []
        try:
            _ip("netns", "add", self.switch)
            self._made.append(self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for i in range(n):
                ns = self.ns(i)
                _ip("netns", "add", ns)
                self._made.append(ns)
                self._link(f"{tag}h{i}", ns, f"{self.addr(i)}/24")
                _ip("-n", ns, "link", "set", "lo", "up")
            self._link(f"{tag}rt", None, f"{self.subnet}.254/24")  # the test's own leg on the bridge
        except BaseException:
            self.close()
            raise

    def _link(self, name: str, ns: str | None, cidr: str) -> None:
        """A veth pair: `name` (given `cidr`) in `ns` (None: here), its peer `name`b on the bridge."""
        _ip("link", "add", name, "type", "veth", "peer", "name", f"{name}b")
        _ip("link", "set", f"{name}b", "netns", self.switch)
        _ip("-n", self.switch, "link", "set", f"{name}b", "master", "br0")
        _ip("-n", self.switch, "link", "set", f"{name}b", "up")
        inside = ["-n", ns] if ns else []
        if ns:
            _ip("link", "set", name, "netns", ns)
        _ip(*inside, "addr", "add", cidr, "dev", name)
        _ip(*inside, "link", "set", name, "up")

    def ns(self, i: int) -> str:
        return f"{self.tag}h{i}"

    def addr(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    # --------------------------------------------------------------------------- processes

    def run(self, i: int, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start `argv` on host i (output in workdir/NAME.log)."""
        with open(self.workdir / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(["ip", "netns", "exec", self.ns(i), *argv], stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=os.environ | (env or {}), preexec_fn=die_with_parent)
        self.procs.append((name, proc))
        return proc

    def log(self, name: str) -> str:
        return (self.workdir / f"{name}.log").read_text(errors="replace")

    def nats_node(self, i: int, nodes: int) -> subprocess.Popen:
        """nats-server on host i (port 4222) as node i of a JetStream cluster over hosts 0 … nodes-1
        (routes on 6222); `nodes` = 1: on its own."""
        routes = ",".join(f"nats://{self.addr(j)}:6222" for j in range(nodes) if j != i)
        store = self.workdir / f"nats-{i}"
        store.mkdir(parents=True, exist_ok=True)
        argv = [nats_server_binary(), "-js", "-a", self.addr(i), "-p", "4222", "-sd", str(store), "--server_name", f"nats-{i}"]
        if nodes > 1:  # the product's route liveness (start_nats_cluster's), so a healed link carries messages again
            argv += ["-c", str(nats_cluster_conf(self.workdir / f"nats-{i}.conf")),
                     "--cluster_name", "pdserve", "--cluster", f"nats://{self.addr(i)}:6222", "--routes", routes]
        proc = self.run(i, f"nats-{i}", argv)
        wait_for_port(4222, proc=proc, host=self.addr(i))
        return proc

    def valkey(self, i: int) -> subprocess.Popen:
        proc = self.run(i, "valkey", [valkey_server_binary(), "--port", "6379", "--bind", self.addr(i), "--save", "",
                                      "--protected-mode", "no", "--appendonly", "no", "--dir", str(self.workdir)])
        wait_for_port(6379, proc=proc, host=self.addr(i))
        return proc

    def service(self, i: int, name: str, module: str, args: list[str], env: dict[str, str] | None = None):
        return self.run(i, name, [sys.executable, "-m", module, *args], env)

    def stop(self, name: str, sig: int = signal.SIGTERM) -> None:
        for n, proc in self.procs:
            if n == name and proc.poll() is None:
                proc.send_signal(sig)

    # ------------------------------------------------------------------------------ faults

    def partition(self, i: int) -> None:
        """Cut host i off: its link to the bridge goes down (its own loopback keeps working)."""
        _ip("-n", self.switch, "link", "set", f"{self.ns(i)}b", "down")

    def heal(self, i: int) -> None:
        _ip("-n", self.switch, "link", "set", f"{self.ns(i)}b", "up")

    def close(self) -> None:
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 15
        for _, proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        subprocess.run(["ip", "link", "del", f"{self.tag}rt"], capture_output=True)
        for ns in reversed(self._made):  # a namespace takes its links with it
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made = []


class DelayProxy:
    """A TCP proxy adding `delay_s` each way (what netem would do): listens on (host, port) in the
    caller's namespace and forwards to `target`. Runs its own event loop in a thread."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int], delay_s: float):
        self.listen, self.target, self.delay_s = listen, target, delay_s
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True)
        self._thread.start()
        self._ready.wait(10)

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._client, *self.listen))
        self._ready.set()
        self._loop.run_forever()

    async def _client(self, reader, writer) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True)

    async def _pipe(self, reader, writer) -> None:
        """Bytes arrive `delay_s` after they were read, in order (a queue drained by a timed writer)."""
        queue: asyncio.Queue = asyncio.Queue()

        async def send() -> None:
            while (item := await queue.get()) is not None:
                due, data = item
                await asyncio.sleep(max(0.0, due - self._loop.time()))
                writer.write(data)
                await writer.drain()
            writer.close()

        sender = asyncio.ensure_future(send())
        try:
            while data := await reader.read(65536):
                queue.put_nowait((self._loop.time() + self.delay_s, data))
        finally:
            queue.put_nowait(None)
            await sender

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._server.close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
