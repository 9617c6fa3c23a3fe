"""Routing through a real `pdserve up` (services/gateway/router.py): where jobs go is read from the
gateway's own counters (pdserve_router_jobs_total{pool,worker,reason}) and /router, and whether the
cache was really hit from each response's usage.cached_tokens.

    2 colocated workers (each its own engine cache)    holder chosen · hot holder spilled · zero
                                                        reuse spread · gateway restart rebuilds the
                                                        index · a killed worker's entries go, a
                                                        stale one is a miss
    2 played hosts (a kvstore + a prefill worker each,  the host holding the prefix chosen; decode
    1 decode worker; KV between hosts over NATS)        reads the other host's blocks, same text
    conditional (1 prefill + 1 decode)                  short and mostly-cached prompts prefilled
                                                        by decode, long ones by the prefill pool
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.services.test_e2e import MODEL
from tests.services.test_up_supervision import leftovers, start_up, wait_restarted, wait_up_healthy

pytestmark = pytest.mark.slow


def document(n: int, paragraphs: int = 30) -> str:
    return " ".join(f"Document {n}, paragraph {i}: the {['red', 'green', 'blue'][i % 3]} fox number {i} "
                    f"jumps over the lazy dog {i * 7 + n}." for i in range(paragraphs))


def ask(url: str, content: str, max_tokens: int = 8) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0.0}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def routed(url: str) -> Counter:
    """(pool, worker, reason) → jobs, from the gateway's counters."""
    out = Counter()
    for m in re.finditer(r'^pdserve_router_jobs_total\{pool="([^"]*)",reason="([^"]*)",worker="([^"]*)"\} (\S+)$',
                         httpx.get(f"{url}/metrics", timeout=10).text, re.M):
        out[(m[1], m[3], m[2])] += int(float(m[4]))
    return out


def since(url: str, before: Counter) -> Counter:
    return routed(url) - before


def locations(url: str) -> dict[str, dict]:
    """The gateway's routing index: location → {blocks, seq, epoch, …}."""
    return httpx.get(f"{url}/router", timeout=10).json()["index"]["locations"]


def index_blocks(url: str) -> dict[str, int]:
    return {name: loc["blocks"] for name, loc in locations(url).items()}


def wait_for(probe, what: str, bound: float = 30.0, seen=None):
    """`probe()` once it is truthy; `seen()`, if given, says what there was instead on a timeout."""
    deadline = time.monotonic() + bound
    while True:
        value = probe()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}" + (f": {seen()}" if seen else "")
        time.sleep(0.2)


def settled(probe, what: str, quiet_s: float = 1.0, bound: float = 30.0):
    """`probe()` once it has stayed the same for `quiet_s`."""
    last = [probe(), time.monotonic()]

    def same():
        value = probe()
        if value != last[0]:
            last[:] = [value, time.monotonic()]
        return time.monotonic() - last[1] >= quiet_s

    wait_for(same, what, bound, seen=lambda: last[0])
    return last[0]


@contextlib.contextmanager
def serving(workdir, workers: int, *args: str):
    """`pdserve up ARGS`, healthy and with every worker's stats heard by the router; stopped with
    SIGTERM at the end (exit 0, nothing left behind), killed if the body failed."""
    up = start_up(workdir, *args)
    try:
        wait_up_healthy(up, timeout=150)
        wait_for(lambda: len(httpx.get(f"{up.url}/router", timeout=10).json()["workers"]) == workers,
                 f"{workers} workers' stats")
        yield up
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(60) == 0, up.log()[-3000:]
        assert not leftovers(up), leftovers(up)
    finally:
        if up.proc.poll() is None:
            up.proc.kill()
            up.proc.wait(10)


@pytest.fixture(scope="module")
def colocated(tmp_path_factory):
    with serving(tmp_path_factory.mktemp("routing-colocated"), 2, "--mode", "colocated", "--decode", "2",
                 "--speculative", "off") as up:
        yield up


def test_shared_prefix_goes_to_its_holder_then_spills_to_the_other_when_the_holder_is_hot(colocated):
    url, doc = colocated.url, document(1)
    first = ask(url, f"{doc}\nWhich colour is paragraph 0?")
    holder = next(w for (_, w, _), n in routed(url).items() if n)
    before = routed(url)
    for q in range(1, 4):  # one after another: each finds the document where the first one left it
        data = ask(url, f"{doc}\nWhich colour is paragraph {q}?")
        assert data["usage"]["prompt_tokens_details"]["cached_tokens"] >= data["usage"]["prompt_tokens"] - 64
    assert since(url, before) == Counter({("colocated", holder, "cache"): 3}), since(url, before)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # many at once on the same document: the holder's running sequences make it hot, and some of the
    # requests go to the other worker (which computes the document once and then holds it too)
    before = routed(url)
    with ThreadPoolExecutor(16) as pool:
        futures = []
        for q in range(16):
            futures.append(pool.submit(ask, url, f"{doc}\nWhat does fox {q} jump over?", 64))
            time.sleep(0.15)
        results = [f.result() for f in futures]
    got = since(url, before)
    other = next(w for w in index_blocks(url) if w != f"worker.{holder}").removeprefix("worker.")
    assert got[("colocated", holder, "cache")] >= 4, got
    assert got[("colocated", other, "hot-spot")] >= 1, got
    assert all(r["choices"][0]["message"]["content"] for r in results)


def test_zero_reuse_spreads_evenly(colocated):
    url = colocated.url
    before = routed(url)
    with ThreadPoolExecutor(12) as pool:
        list(pool.map(lambda i: ask(url, f"{document(100 + i, 12)}\nSummarise.", 4), range(12)))
    per_worker = Counter()
    for (_, worker, _), n in since(url, before).items():
        per_worker[worker] += n
    assert sum(per_worker.values()) == 12 and len(per_worker) == 2, per_worker
    assert max(per_worker.values()) <= 1.3 * 12 / 2, per_worker


def test_a_restarted_gateway_rebuilds_the_index_and_a_killed_workers_entries_go(colocated):
    url, doc = colocated.url, document(2)
    before = routed(url)
    ask(url, f"{doc}\nFirst question.")
    [(_, holder, _)] = since(url, before)
    blocks = settled(lambda: index_blocks(url), "the index to settle")  # the last batch of events is out
    assert max(blocks.values()) >= 30, blocks
    old = colocated.children()["gateway"]
    os.kill(old, signal.SIGKILL)
    wait_restarted(colocated, "gateway", old)
    wait_up_healthy(colocated, timeout=60)
    # the new gateway read the snapshots in Valkey (and the events after them): the same index
    wait_for(lambda: index_blocks(url) == blocks, f"the rebuilt index ({blocks})", 30, seen=lambda: index_blocks(url))
    # (until it hears the workers' stats, ~0.25 s, it would send jobs to the shared queue)
    wait_for(lambda: len(httpx.get(f"{url}/router", timeout=10).json()["workers"]) == 2, "the workers' stats")
    before = routed(url)
    assert ask(url, f"{doc}\nSecond question.")["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert since(url, before) == Counter({("colocated", holder, "cache"): 1})
    # kill the holder: its index entries are stale until its restart is heard; a request sent now
    # is routed by them, misses (the worker is dead), is resubmitted to the shared queue, and succeeds
    location = f"worker.{holder}"
    old_epoch = locations(url)[location]["epoch"]
    victim = colocated.children()[holder]
    os.kill(victim, signal.SIGKILL)
    data = ask(url, f"{doc}\nThird question.")
    assert data["choices"][0]["message"]["content"]
    wait_restarted(colocated, holder, victim)
    # the restarted worker is a new epoch, starting empty: the index drops the old process's entries
    restarted = wait_for(lambda: (loc := locations(url).get(location)) and loc["epoch"] != old_epoch and loc,
                         "the restarted worker's new epoch")
    # and holds what the new process holds: the document only if the third question ran there (the
    # restarted worker came up before the gateway gave up on it and took the job from its own
    # subject), else at the other worker. A fourth question goes to that one and finds it cached.
    holds = holder if restarted["blocks"] else next(w for w in index_blocks(url) if w != location).removeprefix("worker.")
    before = routed(url)
    data = ask(url, f"{doc}\nFourth question.")
    assert since(url, before) == Counter({("colocated", holds, "cache"): 1}), (restarted, since(url, before))
    assert data["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_two_hosts_route_to_the_host_holding_the_prefix(tmp_path):
    with serving(tmp_path, 3, "--hosts", "2", "--prefill", "2", "--decode", "1", "--speculative", "off",
                 "--kv-slots", "512") as up:
        # two documents at once: the second goes to the other host (the first host's load is the
        # first document; asked one after the other, both would go to the host that already holds
        # the chat template's blocks)
        holders, futures = {}, {}
        with ThreadPoolExecutor(2) as pool:
            for d in (3, 4):
                before = routed(up.url)
                futures[d] = pool.submit(ask, up.url, f"{document(d)}\nWhich colour is paragraph 2?", 16)
                holders[d] = wait_for(lambda: next((w for (_, w, _) in since(up.url, before)), None), "a route")
            texts = {d: f.result()["choices"][0]["message"] for d, f in futures.items()}
        assert sorted(holders.values()) == ["prefill-0", "prefill-1"], holders
        for d in (3, 4):  # asked again: to the host whose kvstore holds it; the same greedy answer
            before = routed(up.url)
            data = ask(up.url, f"{document(d)}\nWhich colour is paragraph 2?", 16)
            assert since(up.url, before) == Counter({("prefill", holders[d], "cache"): 1}), since(up.url, before)
            assert data["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            assert data["choices"][0]["message"] == texts[d]
        decode_log = (tmp_path / "decode-0.log").read_text()
        assert "over the network path" in decode_log  # decode-0 read the other host's blocks over NATS


def test_conditional_sends_short_and_mostly_cached_prompts_to_decode_and_long_ones_to_prefill(tmp_path):
    with serving(tmp_path, 2, "--mode", "conditional", "--speculative", "off") as up:
        url, doc = up.url, document(5)
        before = routed(url)
        ask(url, "What is the capital of France?")
        ask(url, f"{doc}\nQuestion one.")
        time.sleep(0.5)  # the decode worker's engine cache now holds the document (its events are out)
        data = ask(url, f"{doc}\nQuestion two.")
        pools = Counter({(pool, reason): n for (pool, _, reason), n in since(url, before).items()})
        assert pools == Counter({("decode", "short"): 1, ("prefill", "long"): 1, ("decode", "cached"): 1}), pools
        assert data["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
