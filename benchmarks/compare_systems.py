"""The systems `bench_compare.py` puts side by side, each started and stopped whole, one at a time, and
a CPU monitor that says how much of the machine other processes took while one was measured.

    pdserve (disaggregated / colocated / …)   the `pdserve up` machinery (services.up), own NATS + Valkey
    llama-server                              llama.cpp's server on the same GGUF file

Every system is stopped, and checked to be gone, before the next one starts.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

LLAMA_SLOTS = 16  # -np: the concurrency-16 measurement needs 16 slots
LLAMA_CTX_PER_SLOT = 4096  # a long-doc prompt (≤ 3,000 tokens + framing) plus its output fits


@dataclass(frozen=True)
class SystemSpec:
    key: str  # short name used in tables and files
    title: str
    kind: str  # "pdserve" | "llama"
    args: tuple[str, ...] = ()  # `pdserve up` arguments, or extra llama-server flags
    threads: str = ""  # for the report: how the 2 cores are used


SYSTEMS = {
    "disagg": SystemSpec("disagg", "pdserve disaggregated", "pdserve", ("--mode", "disaggregated", "--prefill", "1",
                                                                       "--decode", "1"),
                         "1 prefill + 1 decode worker, 1 thread each"),
    "coloc": SystemSpec("coloc", "pdserve colocated", "pdserve", ("--mode", "colocated", "--decode", "1"),
                        "1 engine worker, 2 threads, chunked prefill (512-token budget)"),
    "coloc-nochunk": SystemSpec("coloc-nochunk", "pdserve colocated, no chunking", "pdserve",
                                ("--mode", "colocated", "--decode", "1", "--worker-arg=--no-chunked-prefill"),
                                "1 engine worker, 2 threads, whole prompts in one step"),
    "llama": SystemSpec("llama", "llama.cpp llama-server", "llama", (), "-t 2, continuous batching, 16 slots"),
    # for the prefix-cache comparison only
    "coloc-noprefix": SystemSpec("coloc-noprefix", "pdserve colocated, no prefix cache", "pdserve",
                                 ("--mode", "colocated", "--decode", "1", "--worker-arg=--no-prefix-caching"),
                                 "1 engine worker, 2 threads"),
    "llama-noprefix": SystemSpec("llama-noprefix", "llama-server, no prompt cache", "llama",
                                 ("--no-cache-prompt", "--cache-ram", "0"), "-t 2, 16 slots"),
}


def find_llama_server(explicit: str | None) -> Path:
    """The llama-server binary: --llama-server, $LLAMA_SERVER, or the cache benchmarks/build_llama_server.sh fills."""
    home = Path(os.environ.get("PDSERVE_HOME", Path.home() / ".cache" / "pdserve"))
    for candidate in (explicit, os.environ.get("LLAMA_SERVER"), home / "llama.cpp" / "build" / "bin" / "llama-server",
                      shutil.which("llama-server")):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return Path(candidate)
    raise FileNotFoundError("llama-server not found: run benchmarks/build_llama_server.sh (or pass --llama-server)")


@functools.cache
def llama_repack_works(binary: Path, model: Path) -> bool:
    """Whether llama.cpp's default weight repacking survives a batch on this CPU. With AMX, its AMX
    matmul (used for repacked weights) crashed on every prompt batch on one machine here; there the
    server runs with --no-repack (the file's weights as they are). Probed once with the llama-bench
    built beside the server."""
    bench = binary.with_name("llama-bench")
    if not bench.is_file():
        return True
    res = subprocess.run([str(bench), "-m", str(model), "-t", "2", "-p", "32", "-n", "0", "-r", "1"],
                         capture_output=True, timeout=300)
    return res.returncode == 0


def llama_command(binary: Path, model: Path, port: int, extra: tuple[str, ...]) -> list[str]:
    # continuous batching is on by default in this build (-cb); the prompt cache too (--cache-prompt,
    # plus the --cache-ram host cache, 8 GiB); --cache-reuse stays 0 (no KV shifting)
    repack = () if llama_repack_works(binary, model) else ("--no-repack",)
    return [str(binary), "-m", str(model), "-t", "2", "-np", str(LLAMA_SLOTS), "-c",
            str(LLAMA_SLOTS * LLAMA_CTX_PER_SLOT), "--host", "127.0.0.1", "--port", str(port), "--no-webui",
            *repack, *extra]


def _stat_cpu_s(pid: int) -> float:
    """utime + stime of a live process (all its threads), in seconds; 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _machine_busy_s() -> float:
    # cpu  user nice system idle iowait irq softirq steal …   (clock ticks)
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


@dataclass
class CpuMonitor:
    """Cores kept busy by processes other than the system under test and this benchmark."""

    pids: list[int]
    wall: float = field(default_factory=time.perf_counter)
    busy: float = field(default_factory=_machine_busy_s)
    ours: float = 0.0

    def __post_init__(self) -> None:
        self.ours = self._ours()

    def _ours(self) -> float:
        return time.process_time() + sum(_stat_cpu_s(p) for p in self.pids)

    def others_cores(self) -> float:
        wall = time.perf_counter() - self.wall
        others = (_machine_busy_s() - self.busy) - (self._ours() - self.ours)
        return max(0.0, others / max(wall, 1e-9))

    def system_cores(self) -> float:
        """Cores the system under test (and this client) used."""
        return (self._ours() - self.ours) / max(time.perf_counter() - self.wall, 1e-9)


class RunningSystem:
    """A started system: its URL, its process ids, and stop()."""

    def __init__(self, spec: SystemSpec, model: Path, llama_binary: Path | None, port: int, workdir: Path):
        self.spec, self.port = spec, port
        self.url = f"http://127.0.0.1:{port}"
        self.command = ""
        self._stack = None
        self._proc: subprocess.Popen | None = None
        workdir.mkdir(parents=True, exist_ok=True)
        if spec.kind == "pdserve":
            self._start_pdserve(model, workdir)
        else:
            self._start_llama(llama_binary, model, workdir)

    def _start_pdserve(self, model: Path, workdir: Path) -> None:
        from services.up import add_up_args, start_stack, wait_healthy

        argv = ["--port", str(self.port), "--model", str(model), *self.spec.args]
        self.command = "pdserve up " + " ".join(argv)
        argv += ["--workdir", str(workdir)]
        parser = argparse.ArgumentParser()
        add_up_args(parser)
        self._stack, _ = start_stack(parser.parse_args(argv))
        try:
            wait_healthy(self._stack, self.url, timeout=180)
        except BaseException:
            self.stop()
            raise

    def _start_llama(self, binary: Path | None, model: Path, workdir: Path) -> None:
        from shared.transport.servers import die_with_parent, wait_for_http_ok

        cmd = llama_command(binary, model, self.port, self.spec.args)
        self.command = " ".join(cmd)
        log = open(workdir / "llama-server.log", "ab")
        self._proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      preexec_fn=die_with_parent, start_new_session=True)
        def check_alive() -> None:
            if self._proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self._proc.returncode}; log: {workdir / 'llama-server.log'}")

        try:
            wait_for_http_ok(f"{self.url}/health", 120, check_alive)
        except BaseException:
            self.stop()
            raise

    @property
    def pids(self) -> list[int]:
        if self._stack is not None:
            return [p.pid for _, p in self._stack.procs] + [s.proc.pid for s in self._stack.servers]
        return [self._proc.pid] if self._proc else []

    def stop(self) -> None:
        """Stop every process and make sure each is gone (no orphans between systems)."""
        if self._stack is not None:
            self._stack.stop()
            procs = [p for _, p in self._stack.procs] + [s.proc for s in self._stack.servers]
        elif self._proc is not None:
            if self._proc.poll() is None:
                self._proc.send_signal(signal.SIGTERM)
                try:
                    self._proc.wait(15)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait()
            procs = [self._proc]
        else:
            procs = []
        alive = [p.pid for p in procs if p.poll() is None]
        if alive:
            raise RuntimeError(f"{self.spec.title}: processes {alive} still running after stop")
