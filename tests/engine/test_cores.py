"""Engines on one host lend each other their cores while idle (shared/engine/cores.py)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from shared.engine.async_engine import AsyncEngine
from shared.engine.cores import CoreShare
from shared.model.sampling_params import SamplingParams
from tests.engine.test_async_engine import collect
from tests.engine.test_engine import make_engine, prompts


def test_a_busy_worker_borrows_the_shares_of_the_idle_ones(tmp_path):
    path = tmp_path / "cores"
    prefill, decode, other = CoreShare(path, 0, 1), CoreShare(path, 1, 1), CoreShare(path, 2, 2)
    assert decode.threads() == 4  # everyone else idle: the whole host
    decode.set_busy(True)
    other.set_busy(True)
    assert decode.threads() == 2 and other.threads() == 3 and prefill.threads() == 1
    prefill.set_busy(True)
    assert (prefill.threads(), decode.threads(), other.threads()) == (1, 1, 2)  # all busy: their own shares
    other.close()  # a worker that is gone lends nothing and borrows nothing
    decode.set_busy(False)
    assert prefill.threads() == 2
    with pytest.raises(ValueError):
        CoreShare(path, 64, 1)
    with pytest.raises(ValueError):
        CoreShare(path, 3, 0)


def test_fair_shares_follow_the_workers_present(tmp_path):
    """`pdserve up`'s default: each worker's share is the host's cores divided among the workers
    present, so the autoscaler's added workers do not oversubscribe the host, and the workers left
    after a drain take its cores back."""
    path = tmp_path / "cores"
    workers = [CoreShare(path, i, None, cores=16) for i in range(2)]
    for w in workers:
        w.set_busy(True)
    assert [w.share for w in workers] == [8, 8]
    workers += [CoreShare(path, i, None, cores=16) for i in (2, 3)]  # two added: idle until they step
    assert [w.share for w in workers] == [4] * 4
    assert workers[0].threads() == 12  # its 4 + the two idle newcomers' 4 each
    for w in workers[2:]:
        w.set_busy(True)
        w.close()  # drained and gone
    assert [w.share for w in workers[:2]] == [8, 8] and workers[0].threads() == 8
    workers[2].set_busy(False)  # a closed worker's late step end writes nothing
    assert workers[0].threads() == 8
    pinned = CoreShare(path, 5, 6, cores=16)  # an explicit --threads 6 beside them, busy
    pinned.set_busy(True)
    assert [w.share for w in workers[:2]] == [5, 5] and pinned.share == 6
    workers[1].set_busy(False)
    assert pinned.threads() == 11 and workers[0].threads() == 10
    assert CoreShare(path, 6, None, cores=2).share == 1  # never below one thread


async def _steps_beside_an_idle_neighbour(tmp_path, record, borrow_from: int = 1) -> int:
    """One 4-token request through an AsyncEngine (core-share slot 0, one thread) beside an idle
    worker (slot 1, one thread); `record(engine, neighbour)` runs before each step. Returns the
    threads the neighbour would take once the engine is idle again."""
    path = tmp_path / "cores"
    neighbour = CoreShare(path, 1, 1)
    engine = make_engine()
    step = engine.step

    def recording_step():
        record(engine, neighbour)
        return step()

    engine.step = recording_step
    async_engine = AsyncEngine(engine, CoreShare(path, 0, 1), borrow_from=borrow_from)
    before = torch.get_num_threads()
    stop = asyncio.Event()
    loop = asyncio.create_task(async_engine.run(stop))
    try:
        tokens, _ = await collect(async_engine.add_request("a", prompts([9])[0], SamplingParams(temperature=0, max_tokens=4)))
        assert len(tokens) == 4
        await asyncio.sleep(0.05)
        return neighbour.threads()
    finally:
        stop.set()
        await loop
        torch.set_num_threads(before)


async def test_the_engine_steps_on_borrowed_cores_and_lends_its_own_when_idle(tmp_path):
    threads_in_steps = []

    def record(engine, neighbour):
        threads_in_steps.append(torch.get_num_threads())
        assert neighbour.threads() == 1  # this engine is busy: nothing to borrow from it

    lent_back = await _steps_beside_an_idle_neighbour(tmp_path, record)
    assert threads_in_steps and set(threads_in_steps) == {2}  # its own share + the idle neighbour's
    assert lent_back == 2  # idle again: its core is lent back


async def test_a_decode_role_engine_borrows_for_a_prompt_but_not_for_a_lone_stream(tmp_path):
    """borrow_from=2 (decode and colocated workers): a batch-1 decode step keeps to its own share,
    a step that computes a prompt's chunk borrows the idle neighbour's core (a colocated engine's
    lone long prompt would otherwise prefill on half the host)."""
    threads_in_steps = []

    def record(engine, neighbour):
        sched = engine.scheduler
        prefilling = any(s.num_new_tokens > 1 for s in (*sched.running, *sched.waiting))
        threads_in_steps.append((prefilling, torch.get_num_threads()))

    await _steps_beside_an_idle_neighbour(tmp_path, record, borrow_from=2)
    assert set(threads_in_steps) == {(True, 2), (False, 1)}
