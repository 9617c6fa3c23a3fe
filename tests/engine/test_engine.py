"""The engine on a tiny random model: prefix reuse, chunked prefill, preemption, abort and the
prefill-only → decode-only hand-off, each checked against a plain run, with exact block accounting."""

from __future__ import annotations

import pytest
import torch

from shared.config import EngineConfig, SpecConfig
from shared.engine.engine import LLMEngine, RequestError
from shared.model.sampling_params import SamplingParams
from tests.model_utils import contiguous_forward, contiguous_greedy, tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=10)
NO_SPEC = SpecConfig(mode="off")  # for the tests that count the tokens computed per step


def make_engine(model=None, **cfg) -> LLMEngine:
    model = model or tiny_model()
    config = EngineConfig(**({"num_kv_blocks": 64, "max_num_batched_tokens": 64, "kv_cache_dtype": "float32"} | cfg))
    return LLMEngine(model, tokenizer=None, config=config, model_id="tiny")


def prompts(lengths, seed=0, vocab=97):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def run_checked(engine: LLMEngine) -> dict[str, list[int]]:
    """Step until done, checking the block invariant after every step."""
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        engine.pool.check_invariants()
    return tokens


def assert_all_blocks_released(engine: LLMEngine) -> None:
    engine.pool.check_invariants()
    assert engine.pool.num_used_blocks == 0
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_batched_engine_matches_each_prompt_alone():
    model = tiny_model()
    engine = make_engine(model)
    ps = prompts([3, 20, 33, 64])
    outs = engine.generate(ps, GREEDY)
    for p, out in zip(ps, outs):
        assert out.new_token_ids == contiguous_greedy(model, p, 10)[0]
        assert out.finish_reason == "length"
    assert_all_blocks_released(engine)


def test_prefix_hit_computes_only_uncached_tokens():
    model = tiny_model()
    engine = make_engine(model, speculative=NO_SPEC)
    shared_prefix = prompts([48], seed=1)[0]  # 3 full blocks
    first = shared_prefix + [1, 2, 3, 4, 5]
    second = shared_prefix + [9, 8, 7]
    [cold] = engine.generate([second], GREEDY)  # reference, computed cold
    engine.pool.reset_prefix_cache()
    engine.generate([first], GREEDY)
    before = engine.stats.tokens_computed
    [warm] = engine.generate([second], GREEDY)
    computed = engine.stats.tokens_computed - before
    assert warm.num_cached_tokens == 48
    # the 3 uncached prompt tokens, then one decode token per step after the first sampled token
    assert computed == 3 + (GREEDY.max_tokens - 1)
    assert warm.new_token_ids == cold.new_token_ids
    assert_all_blocks_released(engine)


def test_fully_cached_prompt_still_computes_its_last_token():
    engine = make_engine(speculative=NO_SPEC)
    p = prompts([32], seed=2)[0]
    [a] = engine.generate([p], GREEDY)
    before = engine.stats.tokens_computed
    [b] = engine.generate([p], GREEDY)
    assert b.num_cached_tokens == 16  # the last full block is recomputed for the logits
    assert engine.stats.tokens_computed - before == 16 + GREEDY.max_tokens - 1
    assert a.new_token_ids == b.new_token_ids


@pytest.mark.parametrize("budget", [5, 16, 23])
def test_chunked_prefill_matches_one_shot(budget):
    model = tiny_model()
    ps = prompts([70, 9, 41], seed=3)
    one_shot = make_engine(model, enable_chunked_prefill=False, enable_prefix_caching=False).generate(ps, GREEDY)
    chunked = make_engine(model, max_num_batched_tokens=budget, enable_prefix_caching=False)
    outs = chunked.generate(ps, GREEDY)
    assert [o.new_token_ids for o in outs] == [o.new_token_ids for o in one_shot]
    assert chunked.stats.steps > len(ps)  # it really was chunked
    assert_all_blocks_released(chunked)


def test_chunked_prefill_interleaves_with_running_decodes():
    engine = make_engine(max_num_batched_tokens=8)
    short, long = prompts([4, 60], seed=4)
    engine.add_request("short", short, SamplingParams(temperature=0.0, max_tokens=20))
    engine.step()  # short is prefilled and decoding
    engine.add_request("long", long, GREEDY)
    sched = engine.scheduler.schedule()
    by_id = {s.seq.request_id: s.num_new_tokens for s in sched.scheduled}
    assert by_id == {"short": 1, "long": 7}  # one decode token + a 7-token chunk = budget 8


def test_preemption_under_tiny_pool_gives_same_outputs_and_no_leak():
    model = tiny_model()
    ps = prompts([30, 25, 40, 18, 33], seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=24)
    expected = [contiguous_greedy(model, p, 24)[0] for p in ps]
    # 12 blocks of 16 tokens: each request needs 3-4 blocks by its end, so 5 cannot run at once
    engine = make_engine(model, num_kv_blocks=12, max_num_batched_tokens=32)
    for i, p in enumerate(ps):
        engine.add_request(str(i), p, params)
    got = run_checked(engine)
    assert engine.stats.preemptions > 0
    assert [got[str(i)] for i in range(len(ps))] == expected
    assert_all_blocks_released(engine)


def test_an_imported_sequence_behind_a_preempted_one_runs_and_neither_waits_for_ever():
    """12 blocks: two requests decode until the newer is preempted; a decode job's KV (3 blocks) is
    imported while it waits; then the older one outgrows the rest and is preempted too. Its prompt
    (10 blocks recomputed) cannot fit while the imported sequence holds its 3, and that one waited
    behind it: nothing ran, for ever. The imported one goes first now, ends, and the rest follow."""
    engine = make_engine(num_kv_blocks=12, max_num_batched_tokens=256, speculative=NO_SPEC)
    a, c, b = prompts([90, 60, 40], seed=11)
    long = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    engine.add_request("a", a, long)
    engine.add_request("c", c, long)
    for _ in range(100):
        engine.step()
        if engine.stats.preemptions:
            break
    assert [s.request_id for s in engine.scheduler.waiting] == ["c"]
    engine.add_prefilled("b", b, 7, engine.kv_cache.empty_blocks(3),
                         SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    finished: dict[str, int] = {}
    for _ in range(1000):
        for out in engine.step():
            finished[out.request_id] = finished.get(out.request_id, 0) + len(out.new_token_ids)
        engine.pool.check_invariants()
        if not engine.has_unfinished():
            break
    assert not engine.has_unfinished(), [(s.request_id, s.num_computed_tokens) for s in engine.scheduler.waiting]
    assert engine.stats.preemptions >= 2 and finished["b"] == 29  # its first token came with its KV
    assert_all_blocks_released(engine)


@pytest.mark.parametrize("steps_before_abort", [1, 2, 6])  # mid-prefill (chunked), just after, mid-decode
def test_abort_frees_every_block(steps_before_abort):
    engine = make_engine(max_num_batched_tokens=16)
    engine.add_request("a", prompts([40], seed=6)[0], SamplingParams(temperature=0.0, max_tokens=50))
    engine.add_request("b", prompts([10], seed=7)[0], SamplingParams(temperature=0.0, max_tokens=50))
    for _ in range(steps_before_abort):
        engine.step()
    assert engine.pool.num_used_blocks > 0
    assert engine.abort("a") and engine.abort("b")
    assert not engine.abort("a")  # unknown now
    assert not engine.has_unfinished()
    assert_all_blocks_released(engine)


def test_abort_waiting_request():
    engine = make_engine(max_num_seqs=1)
    engine.add_request("a", [1, 2, 3], GREEDY)
    engine.add_request("b", [4, 5, 6], GREEDY)
    engine.step()
    assert engine.abort("b")
    run_checked(engine)
    assert_all_blocks_released(engine)


def test_prefill_only_export_then_decode_only_on_second_engine():
    model = tiny_model()
    ps = prompts([5, 16, 37], seed=8)
    colocated = make_engine(model).generate(ps, GREEDY)
    prefill = make_engine(model)
    decode = make_engine(model)
    for i, p in enumerate(ps):
        prefill.add_request(str(i), p, GREEDY, prefill_only=True)
    firsts = {}
    while prefill.has_unfinished():
        for out in prefill.step():
            assert out.finished and out.finish_reason == "prefilled"
            firsts[out.request_id] = out.new_token_ids[0]
    for i, p in enumerate(ps):
        seq, blocks = prefill.export_kv(str(i))
        assert blocks.shape[0] == -(-len(p) // 16)
        decode.add_prefilled(str(i), p, firsts[str(i)], blocks, GREEDY)
    assert_all_blocks_released(prefill)
    got = run_checked(decode)
    for i, out in enumerate(colocated):
        assert [firsts[str(i)]] + got[str(i)] == out.new_token_ids
    assert_all_blocks_released(decode)


def test_prompt_too_long_is_rejected_not_truncated():
    engine = make_engine()  # tiny model: 256-token context
    with pytest.raises(RequestError, match="context length is 256"):
        engine.add_request("x", [1] * 256, GREEDY)
    with pytest.raises(RequestError, match="empty"):
        engine.add_request("y", [], GREEDY)
    with pytest.raises(RequestError, match="token ids"):
        engine.add_request("z", [1, 97], GREEDY)
    engine.add_request("ok", [1] * 200, SamplingParams(temperature=0.0, max_tokens=100))
    [out] = [o for o in run_checked_outputs(engine)]
    assert out.finish_reason == "length" and out.num_output_tokens == 56  # stopped at the context length


def run_checked_outputs(engine):
    finals = []
    while engine.has_unfinished():
        finals += [o for o in engine.step() if o.finished]
    return finals


def test_stop_token_ids_and_min_tokens():
    model = tiny_model()
    engine = make_engine(model)
    p = prompts([12], seed=9)[0]
    free = contiguous_greedy(model, p, 10)[0]
    stop_tok = free[3]
    [out] = engine.generate([p], SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[stop_tok]))
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    assert out.new_token_ids == free[: free.index(stop_tok) + 1]
    [out] = engine.generate([p], SamplingParams(temperature=0.0, max_tokens=10, min_tokens=10,
                                                stop_token_ids=[stop_tok]))
    assert len(out.new_token_ids) == 10 and stop_tok not in out.new_token_ids  # banned until min_tokens


def test_prefix_kv_from_elsewhere_computes_only_the_rest():
    model = tiny_model()
    p = prompts([45], seed=10)[0]
    [expected] = make_engine(model).generate([p], GREEDY)
    source = make_engine(model)
    source.add_request("src", p, GREEDY, prefill_only=True)
    while source.has_unfinished():
        source.step()
    _, blocks = source.export_kv("src")  # 3 blocks: 2 full + a partial one
    target = make_engine(model, speculative=NO_SPEC)
    target.add_request("dst", p, GREEDY, prefix_kv=blocks[:2])  # the whole blocks, as the kvstore keeps them
    got = run_checked(target)
    assert got["dst"] == expected.new_token_ids
    assert target.stats.tokens_computed == (45 - 32) + GREEDY.max_tokens - 1
    assert_all_blocks_released(target)


def test_prompt_logprobs_are_the_teacher_forced_distribution_chunked_and_batched():
    """echo + logprobs: every prompt token's log-probability given the tokens before it, from the
    prefill's own rows — equal to a contiguous forward of each prefix, whether the prompt runs in
    one chunk or several, alone or beside others; never served from the prefix cache."""
    model = tiny_model()
    engine = make_engine(model, max_num_batched_tokens=16, speculative=NO_SPEC)
    prompt, other = prompts([40, 23], seed=5)
    with_lp = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=3)
    engine.add_request("plain", other, GREEDY)
    engine.add_request("lp", prompt, with_lp)
    outs: dict[str, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
        engine.pool.check_invariants()
    firsts = [o.prompt_logprobs for o in outs["lp"]]
    assert firsts[0] is not None and all(f is None for f in firsts[1:])  # handed out once, with token 0
    got = firsts[0]
    assert len(got) == len(prompt) - 1
    for p in range(1, len(prompt)):
        ref = torch.log_softmax(contiguous_forward(model, prompt[:p], None)[0].float(), -1)
        assert got[p - 1].logprob == pytest.approx(ref[prompt[p]].item(), abs=2e-3), p
        top = ref.topk(3)
        assert got[p - 1].top_logprobs == pytest.approx(top.values.tolist(), abs=2e-3), p
        assert got[p - 1].top_ids[0] == top.indices[0].item()
    # the output is a plain run's; asked again (its blocks now cached), the whole prompt is recomputed
    assert [t for o in outs["lp"] for t in o.new_token_ids] == engine.generate([prompt], GREEDY)[0].new_token_ids[:4]
    [again] = engine.generate([prompt], with_lp)
    assert again.num_cached_tokens == 0
    assert [x.logprob for x in again.prompt_logprobs] == pytest.approx([x.logprob for x in got], abs=1e-4)
    assert_all_blocks_released(engine)


def test_each_step_is_logged_where_asked(tmp_path, monkeypatch):
    """PDSERVE_STEP_LOG: a JSON line a step with its prompt and decode rows, its sequences' context
    and its threads and seconds (what the calibration fits a decode step's cost by width from)."""
    import json
    import os

    monkeypatch.setenv("PDSERVE_STEP_LOG", str(tmp_path / "steps-{pid}.jsonl"))
    engine = make_engine(max_num_batched_tokens=32, speculative=SpecConfig(mode="off"))
    for i, p in enumerate(prompts([20, 40])):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=3))
    run_checked(engine)
    steps = [json.loads(line) for line in (tmp_path / f"steps-{os.getpid()}.jsonl").read_text().splitlines()]
    assert len(steps) == engine.stats.steps
    assert sum(s["prompt_rows"] for s in steps) == 60  # both prompts, in chunks of at most 32 tokens
    assert max(s["prompt_rows"] + s["decode_rows"] for s in steps) <= 32
    assert sum(s["decode_rows"] for s in steps) == 2 * 2  # each answer's two tokens after its first
    last = steps[-1]
    assert last["prompt_seqs"] == 0 and last["decode_ctx"] >= 40 and last["threads"] == torch.get_num_threads()
    # no speculation here: a row a sequence, so each row attends over its sequence's context
    assert all(s["decode_row_ctx"] == s["decode_ctx"] for s in steps)
    assert all(s["s"] > 0 for s in steps)
