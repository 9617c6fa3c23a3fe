"""The asyncio wrapper: requests added while steps run, outputs in order, abort, errors as data."""

from __future__ import annotations

import asyncio

from shared.engine.async_engine import AsyncEngine
from shared.engine.engine import RequestError
from shared.model.sampling_params import SamplingParams
from tests.engine.test_engine import make_engine, prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


async def collect(stream):
    tokens = []
    while True:
        item = await stream.get()
        if item.error is not None:
            return item.error
        tokens += item.output.new_token_ids
        if item.output.finished:
            return tokens, item


async def test_concurrent_requests_match_offline_generation():
    engine = make_engine()
    ps = prompts([5, 30, 17], seed=20)
    expected = [o.new_token_ids for o in make_engine().generate(ps, GREEDY)]
    async_engine = AsyncEngine(engine)
    stop = asyncio.Event()
    loop_task = asyncio.create_task(async_engine.run(stop))
    streams = []
    for i, p in enumerate(ps):
        streams.append(async_engine.add_request(str(i), p, GREEDY))
        await asyncio.sleep(0)  # let a step start in between
    results = await asyncio.gather(*(collect(s) for s in streams))
    assert [r[0] for r in results] == expected
    bad = await collect(async_engine.add_request("bad", [], GREEDY))
    assert isinstance(bad, RequestError)
    stop.set()
    await loop_task
    engine.pool.check_invariants()
    assert engine.pool.num_used_blocks == 0


async def test_abort_and_prefill_only_export():
    engine = make_engine()
    async_engine = AsyncEngine(engine)
    stop = asyncio.Event()
    loop_task = asyncio.create_task(async_engine.run(stop))
    long = async_engine.add_request("long", prompts([20], seed=21)[0], SamplingParams(temperature=0.0, max_tokens=200))
    first = await long.get()
    assert not first.output.finished
    async_engine.abort("long")
    tokens, last = await collect(long)
    assert last.output.finish_reason == "abort"
    pre = async_engine.add_request("pre", prompts([40], seed=22)[0], GREEDY, prefill_only=True)
    tokens, item = await collect(pre)
    assert len(tokens) == 1 and item.kv_blocks.shape[0] == 3
    stop.set()
    await loop_task
    engine.pool.check_invariants()
    assert engine.pool.num_used_blocks == 0


async def test_a_second_request_with_a_running_ones_id_is_refused_and_the_first_runs_on():
    """A worker may be handed the same request twice (an old attempt and its resubmission): the
    second is an error for the second caller only; the first still gets every output and frees its
    blocks (a duplicate used to take the first one's stream with it, leaving it to wait forever)."""
    engine = make_engine()
    [p] = prompts([30], seed=23)
    expected = make_engine().generate([p], GREEDY)[0].new_token_ids
    async_engine = AsyncEngine(engine)
    stop = asyncio.Event()
    loop_task = asyncio.create_task(async_engine.run(stop))
    first = async_engine.add_request("same", p, GREEDY)
    second = async_engine.add_request("same", p, GREEDY)
    dup = await collect(second)
    assert isinstance(dup, RequestError) and "already in use" in str(dup)
    tokens, last = await asyncio.wait_for(collect(first), 60)
    assert tokens == expected and last.output.finished
    stop.set()
    await loop_task
    assert engine.pool.num_used_blocks == 0


async def test_queued_tokens_count_only_what_the_prefix_cache_does_not_hold():
    """The router's load measure: a request whose prompt the engine holds cached is a few tokens of
    work, whether it is still on its way in or waiting in the engine (it counted whole, and a holder
    of a shared document looked a prompt busier for each request queued there)."""
    engine = make_engine()
    shared, other = prompts([50, 40], seed=24)
    engine.generate([shared], GREEDY)  # 3 of its blocks are cached now ((50 - 1) // 16)
    async_engine = AsyncEngine(engine)
    async_engine.add_request("hit", shared, GREEDY)
    async_engine.add_request("miss", other, GREEDY)
    async_engine.add_request("logprobs", shared, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0))
    assert async_engine.queued_tokens() == (50 - 48) + 40 + 50  # on their way in (prompt logprobs: every row)
    async_engine._apply_commands()  # what the loop does before a step: now they wait in the engine
    assert len(engine.scheduler.waiting) == 3 and async_engine.incoming_tokens == 0
    assert async_engine.queued_tokens() == (50 - 48) + 40 + 50
    stop = asyncio.Event()
    loop_task = asyncio.create_task(async_engine.run(stop))
    while async_engine.num_requests:
        await asyncio.sleep(0.01)
    assert async_engine.queued_tokens() == 0
    stop.set()
    await loop_task


async def test_a_request_counts_from_when_it_is_submitted_not_from_the_next_step():
    """A decode worker takes another job only while `num_requests` is below its slots. The engine adds
    a submitted request between steps; counted only then, a worker with one slot took a second job
    a moment after the first, and that job sat in the engine's waiting queue, silent, where another
    worker with room could have run it. The duplicate id, refused when its add runs, stops counting."""
    engine = make_engine()
    p, q = prompts([20, 20], seed=25)
    async_engine = AsyncEngine(engine)
    async_engine.add_request("a", p, GREEDY)
    b = async_engine.add_prefilled("b", q, 7, engine.kv_cache.empty_blocks(2), GREEDY)  # (20 tokens: 2 blocks)
    async_engine.add_request("a", p, GREEDY)
    assert async_engine.num_requests == 3  # nothing has been added to the engine yet
    async_engine._apply_commands()
    assert b.queue.empty()  # not refused
    assert async_engine.num_requests == 2 and len(engine.scheduler.waiting) + len(engine.scheduler.running) == 2
