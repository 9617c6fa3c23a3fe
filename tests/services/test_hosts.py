"""pdserve on several hosts: network namespaces on a private bridge (tests/hosts.py), each host with
its own address, a NATS node of one 3-node JetStream cluster, and its own kvstore and workers;
Valkey and the gateway on host 0. The test reaches the gateway over the bridge.

    host 0: nats-0, valkey, gateway        host 1: nats-1, kv-h1, workers        host 2: nats-2, kv-h2, workers

  - KV written on host 1 is decoded on host 2 over the network path: the offline engine's answer
  - KV transfer between hosts vs same-host shared memory, with and without 5 ms added each way
  - host 2 partitioned mid-load: its streams migrate to host 1 or end with an error, none hangs;
    healed, it is heard again and serves
"""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from shared.model.hub import resolve_model_path
from tests.hosts import DelayProxy, PlayedHosts, cannot_play_hosts
from tests.services.test_e2e import MODEL, offline_greedy
from tests.services.test_faults import join_all, stream_events

# serial: these tests time the played hosts (heartbeats, a partition's heal, the KV paths' speeds),
# and beside another test's processes they missed twice in four runs (2026-12-07): the KV read
# through a 5 ms proxy came out faster than the plain one, and after a heal a request got no token
# for 20 s (the gateway's inactivity timeout ended it with a 504)
pytestmark = [pytest.mark.slow, pytest.mark.serial]


def deploy(hosts: PlayedHosts, layout: dict[int, tuple[str, ...]], *gateway_args: str) -> str:
    """NATS nodes on hosts 0-2, Valkey and the gateway on host 0, and per host of `layout` a kvstore
    and the workers named there ("prefill", "decode"). Returns the gateway's URL once healthy."""
    for i in range(3):
        hosts.nats_node(i, 3)
    hosts.valkey(0)
    model = str(resolve_model_path(None))
    env = {"PDSERVE_STREAM_REPLICAS": "3"}

    def conn(i: int) -> list[str]:  # its own host's node first, then the others
        nodes = [i] + [j for j in range(3) if j != i]
        return ["--nats", ",".join(f"nats://{hosts.addr(j)}:4222" for j in nodes),
                "--redis", f"redis://{hosts.addr(0)}:6379"]

    expect = {"prefill": 0, "decode": 0, "kvstore": 0}
    for i, roles in layout.items():
        store = f"kv-h{i}"
        hosts.service(i, f"kvstore-h{i}", "services.kvstore",
                      [*conn(i), "--model", model, "--dtype", "bfloat16", "--store", store, "--num-slots", "512"], env)
        expect["kvstore"] += 1
        for role in roles:
            args = [*conn(i), "--model", model, "--kvstore", store, "--threads", "1", "--instance", f"{role}-h{i}"]
            hosts.service(i, f"{role}-h{i}", f"services.{role}", args + (["--role", "decode"] if role == "decode" else []),
                          env)
            expect[role] += 1
    url = f"http://{hosts.addr(0)}:8000"
    hosts.service(0, "gateway", "services.gateway",
                  [*conn(0), "--model", model, "--host", hosts.addr(0), "--port", "8000", "--mode", "disaggregated",
                   "--expect", ",".join(f"{k}={v}" for k, v in expect.items()), *gateway_args], env)
    deadline = time.monotonic() + 180
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        dead = [name for name, proc in hosts.procs if proc.poll() is not None]
        assert not dead, f"{dead} exited:\n" + "\n".join(hosts.log(n)[-2000:] for n in dead)
        assert time.monotonic() < deadline, "the deployment did not become healthy"
        time.sleep(0.5)


def ask(url: str, content: str, max_tokens: int) -> str:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0.0}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


@pytest.fixture
def hosts(tmp_path):
    why = cannot_play_hosts()
    if why:
        pytest.skip(why)
    h = PlayedHosts(3, tmp_path)
    yield h
    h.close()


def test_kv_written_on_one_host_is_decoded_on_another_over_the_network(hosts):
    url = deploy(hosts, {1: ("prefill",), 2: ("decode",)})
    prompts = ["What is the capital of France?", "Name three primary colours.",
               " ".join(f"Sentence {i} of a long document about rivers and mountains." for i in range(60))
               + " Summarise it."]
    for p in prompts:  # prefilled on host 1 (its kvstore holds the blocks), decoded on host 2
        assert ask(url, p, 24) == offline_greedy(p, 24), p
    log = hosts.log("decode-h2")
    assert "reading KV from kvstore kv-h1 (another host) over the network path" in log
    assert len(re.findall(r"took request", log)) == len(prompts)


def test_kv_transfer_between_hosts_vs_same_host_shared_memory(hosts, tmp_path):
    """The kvstore micro-benchmark's client (a 2,000-token prompt's 125 blocks) on the store's own
    host over shared memory and over NATS, on another host over NATS across the bridge, and there
    through a proxy adding 5 ms each way. Printed for RELIABILITY.md; checked: every path moves the
    blocks (the bench verifies the bytes), and the added latency shows."""
    hosts.nats_node(0, 1)
    hosts.valkey(0)
    nats_url = f"nats://{hosts.addr(0)}:4222"
    hosts.service(1, "kvstore-h1", "services.kvstore",
                  ["--nats", nats_url, "--redis", f"redis://{hosts.addr(0)}:6379", "--model",
                   str(resolve_model_path(None)), "--dtype", "bfloat16", "--store", "kv-h1", "--num-slots", "512"])
    proxy = DelayProxy((f"{hosts.subnet}.254", 14222), (hosts.addr(0), 4222), 0.005)
    try:
        runs = {"host 1 (the store's), shared memory": (1, nats_url, "shm"),
                "host 1 (the store's), network": (1, nats_url, "network"),
                "host 2, network": (2, nats_url, "network"),
                "host 2, network + 5 ms each way": (2, f"nats://{hosts.subnet}.254:14222", "network")}
        results = {}
        for k, (name, (host, url, path)) in enumerate(runs.items()):
            out = tmp_path / f"kv-{k}.json"
            proc = hosts.service(host, f"bench-{k}", "services.kvstore.bench",
                                 ["--store", "kv-h1", "--nats", url, "--paths", path, "--repeat", "5", "--json", str(out)])
            assert proc.wait(300) == 0, hosts.log(f"bench-{k}")
            results[name] = json.loads(out.read_text())["paths"][path]
    finally:
        proxy.close()
    print("\nKV transfer of 125 blocks (46 MB):")
    for name, r in results.items():
        print(f"  {name:40s} write {1e3 * r['write_s']:7.1f} ms ({r['write_gib_s']:.2f} GiB/s)  "
              f"read {1e3 * r['read_s']:7.1f} ms ({r['read_gib_s']:.2f} GiB/s)")
    shm, far, slow = (results[n] for n in ("host 1 (the store's), shared memory", "host 2, network",
                                          "host 2, network + 5 ms each way"))
    assert shm["read_s"] < far["read_s"] and far["read_s"] < slow["read_s"]


def test_a_partitioned_host_s_streams_migrate_or_end_and_it_rejoins_when_healed(hosts):
    url = deploy(hosts, {1: ("prefill", "decode"), 2: ("prefill", "decode")},
                 "--inactivity-timeout", "20")
    prompts = [f"Write a short story about a sailor named Sailor {i}." for i in range(8)]
    results = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, stream_events(url, prompts[i], 64, timeout=120)))
               for i in range(len(prompts))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while "took request" not in hosts.log("decode-h2"):  # host 2 holds streams
        assert time.monotonic() < deadline, "host 2 took no stream"
        time.sleep(0.1)
    time.sleep(0.5)
    hosts.partition(2)
    cut_at = time.monotonic()
    join_all(threads, 120)
    ended_s = time.monotonic() - cut_at
    completed = [i for i, (text, errors, _) in results.items() if not errors and text]
    errored = [i for i, (_, errors, _) in results.items() if errors]
    assert len(completed) + len(errored) == len(prompts)
    migrated = hosts.log("gateway").count("resubmitting (migration")
    assert migrated >= 1  # host 2's streams went to host 1
    # still serving from host 1 while host 2 is cut off, and host 2's workers are out of the router
    assert ask(url, "What is the capital of France?", 8)
    # host 2's workers leave the router once their heartbeats lapse (the registry's TTL, 5 s): the
    # streams can all have ended before that
    deadline = time.monotonic() + 30
    while host2_heard(url):
        assert time.monotonic() < deadline, httpx.get(f"{url}/router", timeout=10).json()["workers"]
        time.sleep(0.5)
    hosts.heal(2)
    healed_at = time.monotonic()
    deadline = healed_at + 60
    while host2_heard(url) != {"prefill-h2", "decode-h2"}:
        assert time.monotonic() < deadline, "host 2's workers are not heard again after the heal"
        time.sleep(0.5)
    rejoined_s = time.monotonic() - healed_at
    # and host 2 serves again: of bursts of requests (the decode queue is pulled by both hosts'
    # workers), its decode worker takes some
    taken = hosts.log("decode-h2").count("took request")
    burst = 0
    while hosts.log("decode-h2").count("took request") == taken:
        assert time.monotonic() < deadline, "host 2's decode worker takes no job after the heal"
        with ThreadPoolExecutor(6) as pool:
            assert all(pool.map(lambda i: ask(url, f"Tell me about the number {burst * 6 + i}.", 16), range(6)))
        burst += 1
    print(f"\nhost 2 partitioned with 8 streams: {len(completed)} completed, {len(errored)} errored, 0 hung, "
          f"{migrated} migrations, all ended {ended_s:.1f} s after the cut; heard again {rejoined_s:.1f} s after "
          "the heal, and serving")


def host2_heard(url: str) -> set[str]:
    return {w for w in httpx.get(f"{url}/router", timeout=10).json()["workers"] if w.endswith("-h2")}
