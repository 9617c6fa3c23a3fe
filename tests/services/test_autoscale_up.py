"""`pdserve up --autoscale` for real (small): under load a decode worker is added (it starts, is
heard, serves); when traffic stops it is drained and retired, never beyond the budget; every
request completes. The policy itself is tested fast against a simulated system
(tests/planner/test_autoscale.py); this shows the wiring: the gateway's metrics in, supervised
processes out."""

from __future__ import annotations

import re
import threading
from contextlib import contextmanager

import httpx
import pytest

from shared.engine.cores import FAIR, SLOTS, UNUSED
from tests.services.test_routing_e2e import ask, document, serving, wait_for

pytestmark = pytest.mark.slow


def workers(url: str) -> set[str]:
    return set(httpx.get(f"{url}/router", timeout=10).json()["workers"])


def core_shares(workdir) -> dict[int, int]:
    """The core-share file's present slots (shared/engine/cores.py): slot → its share byte (0: fair)."""
    data = (workdir / "cores").read_bytes()
    return {i: data[2 * i + 1] for i in range(SLOTS) if data[2 * i] != UNUSED}


def busy_s(url: str, instance: str) -> float:
    """The engine step time the worker has reported (pdserve_engine_busy_seconds_total)."""
    m = re.search(rf'^pdserve_engine_busy_seconds_total{{[^}}]*instance="{instance}"[^}}]*}} (\S+)$',
                  httpx.get(f"{url}/metrics", timeout=10).text, re.M)
    return float(m[1]) if m else 0.0


@contextmanager
def asking(url: str, users: int = 3, max_tokens: int = 24,
           prompt=lambda u, i: f"User {u} asks: tell me about the number {i}."):
    """`users` clients asking back to back until the block ends: yields (answers, errors so far)."""
    stop, answers, errors = threading.Event(), [], []

    def user(u: int) -> None:
        while not stop.is_set():
            try:
                answers.append(ask(url, prompt(u, len(answers)), max_tokens))
            except Exception as exc:  # noqa: BLE001 — reported by the caller
                errors.append(repr(exc))

    threads = [threading.Thread(target=user, args=(u,)) for u in range(users)]
    for t in threads:
        t.start()
    try:
        yield answers, errors
    finally:
        stop.set()
        for t in threads:
            t.join(60)


def test_under_load_a_decode_worker_is_added_then_drained_when_traffic_stops(tmp_path):
    # an ITL SLO of 1 ms: any decoding is over it (hot); no traffic at all is cold
    with serving(tmp_path, 2, "--autoscale", "--max-decode", "2", "--max-prefill", "1", "--autoscale-interval", "1",
                 "--slo-itl-p90-ms", "1", "--speculative", "off") as up:
        assert workers(up.url) == {"prefill-0", "decode-0"}
        with asking(up.url, max_tokens=24) as (answers, errors):
            wait_for(lambda: "decode-1" in workers(up.url), "the added decode worker to be heard", 120)
            wait_for(lambda: busy_s(up.url, "decode-1") > 0, "the added decode worker to serve", 60)
            # the host's cores are divided among the three workers present, not kept at the two's shares
            assert core_shares(tmp_path) == {0: FAIR, 1: FAIR, 3: FAIR}
        assert not errors, errors[:3]
        assert answers and all(a["choices"][0]["message"]["content"] for a in answers)
        # traffic stopped: cold for down_after intervals → the least loaded decode worker drains and exits
        wait_for(lambda: "decode-1 retired" in up.log(), "decode-1 to be drained and retired", 60)
        wait_for(lambda: workers(up.url) == {"prefill-0", "decode-0"}, "decode-1 to leave the router", 30)
        assert core_shares(tmp_path) == {0: FAIR, 1: FAIR}  # its slot freed: its cores are the others' again
        log = up.log()
        decisions = re.findall(r"autoscale: ([+-]) (\w+) (\S+)", log)
        assert decisions == [("+", "decode", "decode-1"), ("-", "decode", "decode-1")], \
            re.findall(r"autoscale: .*", log)
        # of the two idle decode workers the newest, chosen by the load the gateway's metrics showed for each
        assert re.search(r"- decode decode-1 draining \(cold \d+ intervals; it holds 0 requests\)", log), log[-3000:]
        assert "draining" in (tmp_path / "decode-1.log").read_text()
        # still serving with the minimum
        assert ask(up.url, "What is the capital of France?")["choices"][0]["message"]["content"]


def test_the_forecast_policy_sizes_the_prefill_pool_from_the_profile_and_the_prompts(tmp_path):
    """No --capacity: the pools are sized from the shipped profile and the finished requests' prefill
    seconds. Two users sending ~700-token documents back to back keep more than one prefill
    worker's worth of prompts within a 1 s TTFT: a second one is started; when they stop, drained."""
    with serving(tmp_path, 2, "--autoscale", "--policy", "forecast", "--startup-s", "0", "--headroom", "0",
                 "--max-prefill", "2", "--max-decode", "1", "--autoscale-interval", "2", "--slo-ttft-p90-ms", "1000",
                 "--speculative", "off") as up:
        assert "each pool sized from the profile" in up.log()
        documents = lambda u, i: f"{document(100 * u + i)}\nSummarise the document above."  # noqa: E731
        with asking(up.url, users=2, max_tokens=4, prompt=documents) as (_, errors):
            wait_for(lambda: "prefill-1" in workers(up.url), "the added prefill worker to be heard", 120)
            wait_for(lambda: busy_s(up.url, "prefill-1") > 0, "the added prefill worker to serve", 60)
        assert not errors, errors[:3]
        wait_for(lambda: workers(up.url) == {"prefill-0", "decode-0"}, "the pool back at one worker", 90)
        decisions = re.findall(r"autoscale: ([+-]) (\w+) (\S+) \S* ?\(forecast", up.log())
        assert decisions[0] == ("+", "prefill", "prefill-1") and decisions[-1][:2] == ("-", "prefill"), decisions
        assert all(kind == "prefill" for _, kind, _ in decisions), decisions  # decode: one at most, as it was
        assert ask(up.url, "What is the capital of France?")["choices"][0]["message"]["content"]
