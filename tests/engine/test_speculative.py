"""Speculative decoding: exactness (greedy and seeded output as without it, the sampled distribution
the target's), rollback and block accounting, the adaptive plan, and the draft-model proposer."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from shared.config import EngineConfig, SpecConfig
from shared.engine.engine import LLMEngine
from shared.engine.sequence import Sequence
from shared.engine.speculative import Proposal, Speculator, StepCost, SuffixCache
from shared.model.sampling_params import SamplingParams
from tests.engine.test_engine import assert_all_blocks_released, prompts, run_checked
from tests.model_utils import contiguous_forward, tiny_model

OFF = SpecConfig(mode="off")


def engine_for(model, spec: SpecConfig | None = None, draft=None, **cfg) -> LLMEngine:
    config = EngineConfig(**({"num_kv_blocks": 128, "max_num_batched_tokens": 256, "kv_cache_dtype": "float32"}
                             | cfg), speculative=spec or SpecConfig())
    return LLMEngine(model, tokenizer=None, config=config, model_id="tiny", draft_model=draft)


def repetitive_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a phrase (what prompt lookup finds) with random lengths and tails."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        phrase = torch.randint(0, 97, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
        tail = torch.randint(0, 97, (i % 7,), generator=g).tolist()
        out.append(phrase * (2 + i % 3) + tail)
    return out


def run(engine: LLMEngine, ps: list[list[int]], params) -> dict[int, list[int]]:
    params = params if isinstance(params, list) else [params] * len(ps)
    for i, (p, sp) in enumerate(zip(ps, params)):
        engine.add_request(str(i), p, sp)
    got = run_checked(engine)
    return {int(k): v for k, v in got.items()}


def test_greedy_output_is_the_same_with_speculation_alone_and_batched():
    model = tiny_model()
    ps = repetitive_prompts(32) + prompts([5, 17, 30, 41], seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=24)
    expected = run(engine_for(model, OFF), ps, params)
    on = engine_for(model)
    assert run(on, ps, params) == expected  # one batch
    assert_all_blocks_released(on)
    for i, p in enumerate(ps[:12]):  # alone
        [out] = on.generate([p], params)
        assert out.new_token_ids == expected[i]
    s = on.spec.stats
    assert s.num_accepted_tokens > 50, s  # speculation ran and was accepted …
    assert s.num_draft_tokens > s.num_accepted_tokens  # … and rejected, so rollback ran too
    assert_all_blocks_released(on)


def test_seeded_sampling_is_reproduced_token_for_token():
    model = tiny_model()
    ps = repetitive_prompts(16, seed=1)
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=100 + i, max_tokens=20) for i in range(16)]
    on = engine_for(model)
    on.spec.fixed_k = 4  # propose whenever there is a match, whatever the plan would say
    assert run(on, ps, params) == run(engine_for(model, OFF), ps, params)
    assert on.spec.stats.num_accepted_tokens > 0
    assert_all_blocks_released(on)


def test_stop_tokens_and_max_tokens_inside_an_accepted_run():
    model = tiny_model()
    ps = repetitive_prompts(12, seed=2)
    plain = run(engine_for(model, OFF), ps, SamplingParams(temperature=0.0, max_tokens=30))
    on = engine_for(model)
    on.spec.fixed_k = 8
    for i, p in enumerate(ps):
        stop = plain[i][9]
        first = plain[i].index(stop)
        [out] = on.generate([p], SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop]))
        assert out.new_token_ids == plain[i][:first + 1] and out.stop_reason == stop
        [out] = on.generate([p], SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True))
        assert out.new_token_ids == plain[i][:7] and out.finish_reason == "length"
    assert on.spec.stats.num_accepted_tokens > 0
    assert_all_blocks_released(on)


def test_rolled_back_blocks_are_never_cached_and_prefix_hits_give_the_same_output():
    model = tiny_model()
    ps = repetitive_prompts(10, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=40)
    on = engine_for(model, num_kv_blocks=96)
    first = run(on, ps, params)
    assert on.spec.stats.num_draft_tokens > on.spec.stats.num_accepted_tokens  # rejections happened
    # the same prompt + the first answer again: the cached blocks (written around rejected
    # speculative rows) must hold exactly the KV a plain run computes
    again = [p + first[i][:33] for i, p in enumerate(ps)]
    for i, p in enumerate(again):
        [out] = on.generate([p], SamplingParams(temperature=0.0, max_tokens=8))
        [ref] = engine_for(model, OFF).generate([p], SamplingParams(temperature=0.0, max_tokens=8))
        assert out.num_cached_tokens >= 16 * ((len(ps[i]) + 32) // 16) - 16
        assert out.new_token_ids == ref.new_token_ids
    assert_all_blocks_released(on)


def _exact_joint(model, prompt: list[int], temperature: float) -> dict[tuple[int, ...], float]:
    """P(t0, t1, t2) of sampling three tokens after `prompt` (vocab 8): the target's distribution."""
    def probs(ids):
        logits, _ = contiguous_forward(model, ids, None)
        return (logits.double() / temperature).softmax(-1).tolist()

    V = model.config.vocab_size
    out = {}
    p0 = probs(prompt)
    for a in range(V):
        p1 = probs(prompt + [a])
        for b in range(V):
            p2 = probs(prompt + [a, b])
            for c in range(V):
                out[(a, b, c)] = p0[a] * p1[b] * p2[c]
    return out


def test_speculative_sampling_draws_from_the_target_distribution():
    """Unseeded sampling with proposals at every step (prompt lookup always matches here): the joint
    distribution of the first three tokens is the target's, by a chi-square test over 512 cells."""
    model = tiny_model(seed=5, vocab_size=8)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(2.0)  # sharper distributions: proposals are accepted often and rejected often
    prompt = [0, 1, 2, 3, 4, 5, 6, 7, 3, 1, 4, 1, 5, 2, 6, 5, 3, 5, 7, 0, 2, 4, 6, 1, 3]
    exact = _exact_joint(model, prompt, temperature=1.0)
    engine = engine_for(model, max_num_seqs=128, num_kv_blocks=512)
    engine.spec.fixed_k = 3
    n = 12000
    counts: Counter = Counter()
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)
    for start in range(0, n, 500):
        outs = engine.generate([prompt] * 500, params)
        counts.update(tuple(o.new_token_ids) for o in outs)
    s = engine.spec.stats
    assert s.num_accepted_tokens > 0.2 * n and s.num_draft_tokens - s.num_accepted_tokens > 0.2 * n, s
    # cells with an expected count under 5 pooled into one
    chi2, small_obs, small_exp, cells = 0.0, 0, 0.0, 0
    for cell, p in exact.items():
        e = p * n
        if e < 5:
            small_obs += counts[cell]
            small_exp += e
            continue
        chi2 += (counts[cell] - e) ** 2 / e
        cells += 1
    if small_exp > 0:
        chi2 += (small_obs - small_exp) ** 2 / small_exp
        cells += 1
    df = cells - 1
    # the 99.9% quantile of chi-square(df), Wilson–Hilferty
    z = 3.09
    limit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    assert chi2 < limit, f"chi2 {chi2:.1f} over {df} degrees of freedom (limit {limit:.1f})"
    assert_all_blocks_released(engine)


# ------------------------------------------------------------------------------------ the plan


def _seq(i: int) -> Sequence:
    return Sequence(f"s{i}", [1, 2, 3], SamplingParams(temperature=0.0))


def _speculator(table: dict[int, float]) -> Speculator:
    return Speculator(SpecConfig(mode="ngram"), StepCost(table))


def test_plan_speculates_when_rows_are_cheap_and_not_when_they_cost_compute():
    seqs = [_seq(i) for i in range(4)]
    props = [Proposal([5] * 8, "prompt", 3) for _ in seqs]
    cheap = _speculator({1: 0.010, 8: 0.011, 64: 0.013})  # bandwidth-bound: rows nearly free
    assert cheap._plan(seqs, props, rows=4, budget=100, max_k=[8] * 4) == [8, 8, 8, 8]
    dear = _speculator({1: 0.001, 64: 0.064})  # compute-bound: each row costs a token's time
    assert dear._plan(seqs, props, rows=4, budget=100, max_k=[8] * 4) == [0, 0, 0, 0]
    # the budget and each sequence's limit bound it
    assert sum(cheap._plan(seqs, props, rows=4, budget=5, max_k=[8] * 4)) == 5
    assert cheap._plan(seqs, props, rows=4, budget=100, max_k=[2, 0, 8, 8])[:2] == [2, 0]


def test_plan_learns_from_rejections():
    spec = _speculator({1: 0.010, 2: 0.0125, 4: 0.0175, 64: 0.16})  # a row costs a quarter of a step
    seq = _seq(0)
    prop = Proposal([5] * 8, "prompt", 1)
    assert spec._plan([seq], [prop], rows=1, budget=100, max_k=[8])[0] > 0  # the prior: one in two accepted
    for _ in range(30):
        spec.observe(seq, Proposal([5] * 4, "prompt", 1), accepted=0, kept_kv=0)
    assert spec._plan([seq], [prop], rows=1, budget=100, max_k=[8])[0] == 0
    other = _seq(1)  # a new request with proposals of the same kind starts from what the worker learned
    assert spec._plan([other], [prop], rows=1, budget=100, max_k=[8])[0] == 0
    # … but a kind that has been accepted keeps being proposed
    for _ in range(30):
        spec.observe(other, Proposal([5] * 4, "prompt", 4), accepted=4, kept_kv=0)
    assert spec._plan([other], [Proposal([5] * 8, "prompt", 4)], rows=1, budget=100, max_k=[8])[0] >= 4


def test_suffix_cache_proposes_what_an_earlier_answer_said_and_stays_bounded():
    cache = SuffixCache(1, 4, max_tokens=64)
    cache.add([9, 9, 1, 2], [3, 4, 5, 6, 7])
    seq = Sequence("x", [8, 1, 2], SamplingParams())
    assert cache.propose(seq, 8).tokens == [3, 4, 5, 6, 7]  # stops at the end of that answer
    seq.output_ids = [3, 4]
    p = cache.propose(seq, 2)
    assert p.tokens == [5, 6] and p.n == 4
    for i in range(40):
        cache.add([i], [i + 100, i + 101])
    assert len(cache.log) <= 64


# ------------------------------------------------------------------------------ a draft model


def test_draft_model_proposer_keeps_the_target_output():
    target = tiny_model(seed=0)
    ps = prompts([5, 20, 37, 50], seed=7) + repetitive_prompts(4, seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=20)
    expected = run(engine_for(target, OFF), ps, params)
    for draft, min_rate in ((tiny_model(seed=0), 0.9), (tiny_model(seed=1), 0.0)):  # itself; a stranger
        engine = engine_for(target, SpecConfig(mode="draft"), draft=draft)
        engine.spec.fixed_k = 4
        assert run(engine, ps, params) == expected
        s = engine.spec.stats
        assert s.num_draft_tokens > 0 and s.num_accepted_tokens >= min_rate * s.num_draft_tokens, s
        assert_all_blocks_released(engine)
        d = engine.spec.draft
        d.pool.check_invariants()
        assert d.pool.num_used_blocks == 0 and not d.states


def test_draft_mode_needs_a_draft_of_the_same_vocabulary():
    with pytest.raises(ValueError, match="draft model"):
        engine_for(tiny_model(), SpecConfig(mode="draft"))
    with pytest.raises(ValueError, match="vocabulary"):
        engine_for(tiny_model(), SpecConfig(mode="draft"), draft=tiny_model(vocab_size=50))


# ------------------------------------------------------------------------------ the real model

GROUNDED = [
    "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog near the river bank.",
    "Copy this list back to me: apples, oranges, bananas, grapes, pears, plums, cherries.",
    "Here is a function:\n\ndef add(a, b):\n    return a + b\n\nReturn it unchanged, with a docstring added.",
    "Rewrite in the same words: Paris is the capital of France. Berlin is the capital of Germany.",
    "Quote the first line: Twinkle, twinkle, little star, how I wonder what you are.",
    "Summarize, quoting it: The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris.",
    "Say it again: one two three four five six seven eight nine ten.",
    "Extract the names: Alice met Bob and Carol at the station; later Dave and Eve joined them.",
    "Translate to JSON with keys name and age: name is John, age is 31.",
    "Repeat: To be or not to be, that is the question.",
    "Echo this code: for i in range(10):\n    print(i * i)",
    "Write the alphabet from a to m, separated by commas.",
]
OPEN = [
    "What is the capital of France?", "Tell me a short story about a cat.", "Why is the sky blue?",
    "Give me three tips for learning to cook.", "What is photosynthesis?", "Name two planets.",
    "How do airplanes fly?", "Write a haiku about autumn.", "What is a prime number?",
    "Explain what a computer is to a child.",
]


@pytest.mark.slow
def test_real_model_greedy_output_is_the_same_with_speculation(default_gguf):
    """30+ chat prompts (ones that repeat their prompt, open ones, and ones cut by a stop string
    inside a run of accepted proposals): speculation on gives speculation off's tokens and text,
    batched together and one at a time."""
    from shared.model.chat_template import render_chat

    on = LLMEngine.from_config(EngineConfig(model=str(default_gguf), num_kv_blocks=512))
    off = LLMEngine.from_config(EngineConfig(model=str(default_gguf), num_kv_blocks=512, speculative=OFF))
    tok = on.tokenizer
    ids = [tok.encode(render_chat(tok.chat_template, [{"role": "user", "content": q}]), add_special_tokens=False)
           for q in GROUNDED + OPEN]
    greedy = SamplingParams(temperature=0.0, max_tokens=48)
    plain = off.generate(ids, greedy)
    # stop strings: a word from the middle of each grounded answer
    stops = []
    for out in plain[:len(GROUNDED)]:
        words = [w for w in out.text.split() if len(w) > 3]
        stops.append(words[len(words) // 2] if words else "zzz")
    cases = [(p, greedy) for p in ids] + [
        (p, SamplingParams(temperature=0.0, max_tokens=48, stop=[s])) for p, s in zip(ids, stops)]
    expected = [(o.new_token_ids, o.text) for o in plain] + [
        (o.new_token_ids, o.text) for o in off.generate(ids[:len(GROUNDED)], [c[1] for c in cases[len(ids):]])]
    batched = on.generate([c[0] for c in cases], [c[1] for c in cases])
    assert [(o.new_token_ids, o.text) for o in batched] == expected
    alone = [on.generate([p], sp)[0] for p, sp in cases]
    assert [(o.new_token_ids, o.text) for o in alone] == expected
    stopped = alone[len(ids):]
    assert sum(o.stop_reason in stops for o in stopped) >= len(GROUNDED) // 2
    assert any(o.accepted_tokens > 0 for o in stopped if o.stop_reason in stops)
    s = on.spec.stats
    assert s.num_accepted_tokens > 0.3 * s.num_draft_tokens > 0, s
    assert_all_blocks_released(on)
