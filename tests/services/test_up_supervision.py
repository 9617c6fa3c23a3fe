"""`pdserve up` itself, run as a user runs it (a real `pdserve up` process and its real children),
keeps serving when one of its processes dies: SIGKILL each kind of child under a few streams and
check that the killed process comes back, that the stack serves again within a bounded time, that
every stream completed or ended with an error event (none hung), and that no KV block leaked. A
child that crashes at once makes `up` give up with that child's error; SIGTERM stops it cleanly.

One stack serves the whole module (fp32: greedy output cannot depend on batch composition, so a
disturbed run can be compared with an undisturbed one); the SIGTERM test, last, ends it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from shared.transport.servers import die_with_parent, free_port, wait_for_http_ok
from tests.services.test_e2e import MODEL
from tests.services.test_faults import wait_no_blocks_in_use

pytestmark = pytest.mark.slow

SERVING_BOUND_S = 60.0  # the stack must serve again within this long after a kill
STREAM_BOUND_S = 120.0  # every stream must have ended within this long after the kill


# ------------------------------------------------------------------------------------ the stack


@dataclass
class Up:
    proc: subprocess.Popen
    url: str
    workdir: Path

    def children(self) -> dict[str, int]:
        return children_of(self.proc.pid)

    def log(self) -> str:
        return (self.workdir / "up.log").read_text(errors="replace")


def start_up(workdir: Path, *args: str) -> Up:
    """`pdserve up` as a child process of the test (logs in workdir/up.log)."""
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    with open(workdir / "up.log", "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "services.cli", "--log-level", "INFO", "up", "--port", str(port),
                                 "--workdir", str(workdir), *args], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
    return Up(proc, f"http://127.0.0.1:{port}", workdir)


def wait_up_healthy(up: Up, timeout: float = 180.0) -> None:
    def alive() -> None:
        if up.proc.poll() is not None:
            raise AssertionError(f"pdserve up exited with {up.proc.returncode}:\n{up.log()[-3000:]}")

    wait_for_http_ok(f"{up.url}/health", timeout, alive)


def children_of(pid: int) -> dict[str, int]:
    """The live children of `pid` by service name (decode-0, prefill-0, kvstore, gateway, nats,
    valkey), read from /proc. A killed child not yet reaped (a zombie, no cmdline) is left out."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            argv = [a.decode() for a in Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0") if a]
        except OSError:  # exited while we looked
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) != pid or not argv:
            continue
        name = _service_name(argv)
        if name:
            found[name] = int(entry)
    return found


def leftovers(up: Up) -> list[str]:
    """Processes still running that belong to this `up`: their command line names its kvstore
    (`kv-up-<pid>`: kvstore and workers), its workdir (the servers) or its port (the gateway)."""
    marks = (f"kv-up-{up.proc.pid}", str(up.workdir), f"--port {up.url.rsplit(':', 1)[1]} ")
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in (os.getpid(), up.proc.pid):
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(mark in cmdline for mark in marks):
            found.append(f"{entry}: {cmdline[:200]}")
    return found


def _service_name(argv: list[str]) -> str | None:
    if "--instance" in argv:
        return argv[argv.index("--instance") + 1]
    for module, name in (("services.gateway", "gateway"), ("services.kvstore", "kvstore")):
        if module in argv:
            return name
    binary = Path(argv[0]).name
    return "nats" if binary.startswith("nats-server") else "valkey" if "valkey" in binary else None


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    up = start_up(tmp_path_factory.mktemp("up"), "--prefill", "1", "--decode", "2",
                  "--gateway-arg=--inactivity-timeout=30", "--gateway-arg=--shutdown-grace=3",
                  "--worker-arg=--ack-wait=3", "--worker-arg=--lease-ttl=10")
    try:
        wait_up_healthy(up)
        yield up
    finally:
        if up.proc.poll() is None:
            up.proc.send_signal(signal.SIGTERM)
            up.proc.wait(60)


# ---------------------------------------------------------------------------------------- streams


@dataclass
class Outcome:
    text: str = ""
    errors: list[dict] = field(default_factory=list)
    done: bool = False  # data: [DONE] arrived
    broken: str | None = None  # the connection ended without [DONE]

    @property
    def kind(self) -> str:
        if self.done and not self.errors:
            return "completed"
        if self.done:
            return "errored"
        return "broken"


def stream(url: str, content: str, max_tokens: int, *started: threading.Event) -> Outcome:
    """One streaming request; each of `started` is set once it has received text."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, "ignore_eos": True}
    out = Outcome()
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=90) as r:
            if r.status_code != 200:
                out.errors.append({"status": r.status_code, "body": r.read().decode()})
                out.done = True
                return out
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    out.done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        out.errors.append(chunk["error"])
                    for choice in chunk.get("choices", []):
                        out.text += choice["delta"].get("content") or ""
                        if out.text:
                            for event in started:
                                event.set()
    except httpx.HTTPError as exc:
        out.broken = repr(exc)
    return out


class Streams:
    """One streaming request per prompt, each on its own thread."""

    def __init__(self, url: str, prompts: list[str], max_tokens: int):
        self.started = threading.Event()  # some stream has received text
        self.each_started = [threading.Event() for _ in prompts]
        self.results: dict[int, Outcome] = {}
        self.threads = [threading.Thread(target=lambda i=i, p=p: self.results.__setitem__(
            i, stream(url, p, max_tokens, self.started, self.each_started[i])), daemon=True)
            for i, p in enumerate(prompts)]
        for t in self.threads:
            t.start()

    def all_started(self, timeout: float) -> bool:
        """Every stream has received text (within `timeout` s in all)."""
        deadline = time.monotonic() + timeout
        return all(e.wait(max(0.0, deadline - time.monotonic())) for e in self.each_started)

    def join(self, timeout: float) -> dict[int, Outcome]:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        hung = sum(t.is_alive() for t in self.threads)
        assert not hung, f"{hung} streams hung"
        return self.results

    def counts(self) -> dict[str, int]:
        counts = {"completed": 0, "errored": 0, "broken": 0}
        for outcome in self.results.values():
            counts[outcome.kind] += 1
        return counts


def undisturbed(url: str, prompts: list[str], max_tokens: int) -> dict[int, str]:
    streams = Streams(url, prompts, max_tokens)
    results = streams.join(STREAM_BOUND_S)
    assert all(o.kind == "completed" for o in results.values()), results
    return {i: o.text for i, o in results.items()}


def seconds_until_serving(url: str, since: float, bound: float = SERVING_BOUND_S) -> float:
    """Seconds from `since` until a request completes."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4}
    while True:
        try:
            if httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30).status_code == 200:
                return time.monotonic() - since
        except httpx.HTTPError:
            pass  # the gateway itself may be restarting
        assert time.monotonic() - since < bound, f"not serving again {bound:.0f} s after the kill"
        time.sleep(0.2)


def wait_restarted(up: Up, name: str, old_pid: int, bound: float = SERVING_BOUND_S) -> int:
    deadline = time.monotonic() + bound
    while True:
        pid = up.children().get(name)
        if pid is not None and pid != old_pid:
            return pid
        assert time.monotonic() < deadline, f"{name} was not restarted:\n{up.log()[-3000:]}"
        time.sleep(0.1)


def wait_worker_heard(url: str, name: str, bound: float = SERVING_BOUND_S) -> None:
    """Until /health lists the (restarted) worker as alive."""
    deadline = time.monotonic() + bound
    while name not in httpx.get(f"{url}/health", timeout=10).text:
        assert time.monotonic() < deadline, f"{name} does not heartbeat after its restart"
        time.sleep(0.2)


def kill_under_streams(up: Up, victim: str, prompts: list[str], max_tokens: int):
    """SIGKILL `victim` once the streams are producing text; returns (results, counts, seconds
    until serving again, seconds until every stream had ended)."""
    old_pid = up.children()[victim]
    streams = Streams(up.url, prompts, max_tokens)
    assert streams.started.wait(60), "no stream produced text"
    os.kill(old_pid, signal.SIGKILL)
    t_kill = time.monotonic()
    serving: list[float] = []  # probed from the kill on, beside the streams: what a new user sees
    probe = threading.Thread(target=lambda: serving.append(seconds_until_serving(up.url, t_kill)), daemon=True)
    probe.start()
    results = streams.join(STREAM_BOUND_S)
    ended_s = time.monotonic() - t_kill
    wait_restarted(up, victim, old_pid)
    probe.join(SERVING_BOUND_S)
    assert serving, f"not serving again {SERVING_BOUND_S:.0f} s after the kill"
    serving_s = serving[0]
    if victim.startswith(("decode", "prefill")):
        wait_worker_heard(up.url, victim)
    return results, streams.counts(), serving_s, ended_s


# ----------------------------------------------------------------------------------------- memory


def test_only_the_processes_that_run_the_model_load_torch(stack):
    """torch is for the engines. `pdserve up` (it lives as long as the stack), the gateway and the
    kvstore never import it, also after a structured-output request (the gateway compiles its
    grammar): each would otherwise hold 150-250 MB more and spend a second of CPU at every start."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 16,
            "temperature": 0.0, "response_format": {"type": "json_schema", "json_schema": {
                "name": "colour", "schema": {"type": "object", "properties": {"colour": {"type": "string"}}}}}}
    r = httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    processes = {"up": stack.proc.pid, **stack.children()}
    assert {"up", "gateway", "kvstore", "prefill-0", "decode-0"} <= processes.keys(), processes

    def has_torch(pid: int) -> bool:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()

    loaded = {name for name, pid in processes.items() if has_torch(pid)}
    assert loaded == {"prefill-0", "decode-0", "decode-1"}, loaded


# ----------------------------------------------------------------------------------------- kills

VICTIMS = ["decode-0", "prefill-0", "gateway", "nats", "valkey"]


@pytest.mark.parametrize("victim", VICTIMS)
def test_sigkill_a_child_up_restarts_it_and_serves_again(stack, victim):
    prompts = [f"Tell me a story about {victim} number {i}." for i in range(4)]
    results, counts, serving_s, ended_s = kill_under_streams(stack, victim, prompts, 16)
    for i, outcome in results.items():
        if victim == "gateway":  # its connections die with it: a reset, never a hang
            assert outcome.kind in ("completed", "broken"), (i, outcome)
        else:  # no bare close: [DONE], after the tokens or after an error event
            assert outcome.kind in ("completed", "errored"), (i, outcome)
    if victim in ("decode-0", "valkey"):  # migration / a hint store: nothing is lost
        assert counts["completed"] == len(prompts), results
    leaks = wait_no_blocks_in_use(stack.url, 40)
    assert "restarting it" in stack.log() and f"{victim} exited (killed by SIGKILL)" in stack.log()
    print(f"\n| SIGKILL {victim} | {len(prompts)} streams: {counts['completed']} completed / {counts['errored']} errored"
          f" / {counts['broken']} cut / 0 hung (all ended {ended_s:.1f} s after the kill) | serving again "
          f"{serving_s:.1f} s after the kill | blocks in use afterwards {sum(leaks.values()):.0f} |")


def test_kvstore_killed_under_load_output_identical_to_undisturbed(stack):
    """While the kvstore is gone, prefill sends DecodeJobs without blocks and decode recomputes;
    the restarted store is re-attached (a new segment). Greedy fp32 output must not change,
    neither for the requests in flight at the kill nor for later ones."""
    prompts = [f"Describe the island number {i} in detail. " + "It has hills and rivers. " * (10 * i) for i in range(4)]
    expected = undisturbed(stack.url, prompts, 16)
    results, counts, serving_s, ended_s = kill_under_streams(stack, "kvstore", prompts, 16)
    for i, outcome in results.items():
        assert outcome.kind == "completed" and outcome.text == expected[i], (i, outcome)
    # later requests: identical whether the store is still restarting (decode recomputes) or back; asked
    # again until a worker has re-attached to the restarted store (a loaded machine restarts it slowly)
    deadline = time.monotonic() + SERVING_BOUND_S
    while True:
        assert undisturbed(stack.url, prompts, 16) == expected
        workdir_logs = "".join(p.read_text(errors="replace") for p in stack.workdir.glob("*-[0-9].log"))
        if "re-attached to its new segment" in workdir_logs:
            break
        assert time.monotonic() < deadline, "no worker re-attached to the restarted kvstore"
        time.sleep(0.5)
    leaks = wait_no_blocks_in_use(stack.url, 40)
    print(f"\n| SIGKILL kvstore | {len(prompts)} streams: {counts['completed']} completed identically / 0 errored / "
          f"0 hung (all ended {ended_s:.1f} s after the kill); later requests identical too | serving again "
          f"{serving_s:.1f} s after the kill | blocks in use afterwards {sum(leaks.values()):.0f} |")


def test_sigterm_to_up_under_load_ends_every_stream_and_leaves_no_orphan(stack):
    """Short streams complete within the gateway's grace (3 s here); long ones are ended with an error
    event; `up` exits 0 and leaves no process behind. Last in the module: it stops the stack."""
    pids = stack.children()
    assert {"gateway", "kvstore", "prefill-0", "decode-0", "decode-1", "nats", "valkey"} <= set(pids), pids
    short = Streams(stack.url, [f"Name a color, number {i}." for i in range(2)], 8)
    long = Streams(stack.url, [f"Write a long essay about the color number {i}." for i in range(2)], 1000)
    # every stream admitted and streaming: one still on its way in when the stop comes is refused with a 503
    # "shutting down" (as it should be; a CI run's first short stream was), which is not what this tests
    assert short.all_started(60) and long.all_started(60)
    logs = sorted(stack.workdir.glob("*.log"))
    before = {p: p.stat().st_size for p in logs}
    t0 = time.monotonic()
    stack.proc.send_signal(signal.SIGTERM)
    assert stack.proc.wait(90) == 0, stack.log()[-3000:]
    stop_s = time.monotonic() - t0
    for path in logs:  # an orderly stop: no service logs a traceback on its way out
        with open(path, "rb") as f:
            f.seek(before[path])
            written = f.read().decode(errors="replace")
        assert "Traceback" not in written and "never retrieved" not in written, (path.name, written[-3000:])
    for i, outcome in short.join(30).items():
        assert outcome.kind == "completed", (i, outcome)
    for i, outcome in long.join(30).items():
        assert outcome.kind == "errored", (i, outcome)
        assert outcome.errors[0]["message"] == "service shutting down", outcome.errors
    assert not leftovers(stack), leftovers(stack)
    print(f"\n| SIGTERM to pdserve up | 4 streams: 2 completed / 2 errored (service shutting down) / 0 hung"
          f" | exit 0 in {stop_s:.1f} s, no orphans | — |")


def test_child_crashing_at_once_makes_up_exit_with_its_error(tmp_path):
    up = start_up(tmp_path, "--worker-arg=--no-such-flag")
    t0 = time.monotonic()
    try:
        code = up.proc.wait(120)
    except subprocess.TimeoutExpired:
        up.proc.kill()
        raise AssertionError(f"up did not give up within 120 s:\n{up.log()[-3000:]}") from None
    elapsed = time.monotonic() - t0
    log = up.log()
    assert code == 1, log[-3000:]
    assert "keeps crashing" in log and "unrecognized arguments: --no-such-flag" in log, log[-3000:]
    assert not leftovers(up), leftovers(up)
    print(f"\ncrash loop: up exited 1 after {elapsed:.1f} s naming the child's error")


def test_crash_loop_while_serving_ends_open_streams_with_an_error_then_up_exits_1(tmp_path):
    """decode-0 dies right after each start (killed here, 3 times in a row): `up` gives up, but
    first its gateway ends every open stream with an error event; then exit 1, nothing left."""
    up = start_up(tmp_path, "--gateway-arg=--shutdown-grace=1")
    try:
        wait_up_healthy(up)
        streams = Streams(up.url, [f"Write a long essay about the stone number {i}." for i in range(2)], 1000)
        assert streams.all_started(60)  # both streaming: each is to end with the shutdown's error event
        pid = up.children()["decode-0"]
        t0 = time.monotonic()
        for kill in range(3):  # each right after the restart: a crash loop
            os.kill(pid, signal.SIGKILL)
            if kill < 2:
                pid = wait_restarted(up, "decode-0", pid, bound=30)
        assert up.proc.wait(60) == 1, up.log()[-3000:]
        elapsed = time.monotonic() - t0
    finally:
        if up.proc.poll() is None:
            up.proc.kill()
    for i, outcome in streams.join(30).items():
        assert outcome.kind == "errored", (i, outcome)
        assert outcome.errors[-1]["message"] == "service shutting down", outcome.errors
    assert "decode-0 keeps crashing" in up.log() and not leftovers(up), leftovers(up)
    print(f"\ncrash loop while serving: 2 open streams ended with an error event; up exited 1 {elapsed:.1f} s "
          "after the first kill")
