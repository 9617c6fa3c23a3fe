"""The sampler's logit processing (bias, repetition / frequency / presence penalties, min-p) against
a reference written from the definitions, its log-probabilities, and the engine using them with
speculation on and off."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from shared.config import EngineConfig, SpecConfig
from shared.engine.engine import LLMEngine
from shared.model.sampling import TOP_P_CANDIDATES, sample
from shared.model.sampling_params import History, SamplingParams
from tests.engine.test_engine import assert_all_blocks_released, run_checked
from tests.model_utils import tiny_model

V = 50


def reference(row: list[float], p: SamplingParams, h: History) -> list[float]:
    """The processing written out one token at a time."""
    out = list(row)
    for t, b in p.logit_bias.items():
        out[t] += b
    counts = {t: h.output.count(t) for t in set(h.output)}
    for t in range(len(out)):
        if t in counts or t in h.prompt:
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
        if t in counts:
            out[t] -= p.frequency_penalty * counts[t] + p.presence_penalty
    return out


CASES = [
    SamplingParams(temperature=0.0, presence_penalty=1.5),
    SamplingParams(temperature=0.0, frequency_penalty=0.7),
    SamplingParams(temperature=0.0, frequency_penalty=-0.5, presence_penalty=-1.0),
    SamplingParams(temperature=0.0, repetition_penalty=1.3),
    SamplingParams(temperature=0.0, repetition_penalty=0.8),
    SamplingParams(temperature=0.0, logit_bias={3: 100.0, 7: -100.0, 11: 2.5}),
    SamplingParams(temperature=0.0, presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.2,
                   logit_bias={5: 1.0}),
]


@pytest.mark.parametrize("params", CASES, ids=lambda p: "case")
def test_processing_matches_the_definitions(params):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, V, generator=g) * 3
    histories = [History(torch.randint(0, V, (n,), generator=g).tolist(), torch.randint(0, V, (m,), generator=g).tolist())
                 for n, m in ((0, 0), (5, 0), (0, 9), (12, 30))]
    expected = [reference(logits[i].tolist(), params, histories[i]) for i in range(4)]
    plain = SamplingParams(temperature=0.0, logprobs=0)
    rows = torch.cat([logits, logits[:1]])  # a plain row in the same batch is left alone
    work = rows.clone()
    tokens, _ = sample(work, [params] * 4 + [plain], [0] * 5, histories + [None])
    assert torch.allclose(work[:4], torch.tensor(expected), atol=1e-5)
    assert torch.equal(work[4], rows[4])
    assert tokens[:4] == [max(range(V), key=e.__getitem__) for e in expected]


def test_penalized_rows_need_their_histories():
    with pytest.raises(ValueError, match="histories"):
        sample(torch.zeros(1, V), [SamplingParams(temperature=0.0, presence_penalty=1.0)], [0])


def test_logprobs_are_of_the_processed_logits_over_the_temperature():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, V, generator=g)
    h = History([1, 2], [3, 3, 4])
    params = [SamplingParams(temperature=0.0, logprobs=5), SamplingParams(temperature=0.5, seed=3, logprobs=20),
              SamplingParams(temperature=0.0, frequency_penalty=1.0, logprobs=0)]
    tokens, lps = sample(logits.clone(), params, [0, 0, 0], [None, None, h])
    for i, (t, lp, p) in enumerate(zip(tokens, lps, params)):
        row = torch.tensor(reference(logits[i].tolist(), p, h)) if p.penalized else logits[i]
        want = torch.log_softmax(row / (p.temperature or 1.0), -1)
        assert lp.logprob == pytest.approx(float(want[t]), abs=1e-5)
        assert len(lp.top_ids) == p.logprobs == len(lp.top_logprobs)
        assert lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)
        assert lp.top_ids == want.topk(p.logprobs).indices.tolist() if p.logprobs else lp.top_ids == []
        assert sum(math.exp(v) for v in lp.top_logprobs) <= 1.0 + 1e-5
    assert tokens[0] == lps[0].top_ids[0]  # greedy takes the most likely


def test_min_p_keeps_only_tokens_near_the_most_likely():
    logits = torch.full((1, V), -10.0)
    logits[0, :4] = torch.tensor([2.0, 1.9, 0.0, -1.0])  # p ratios to the top: 1, 0.90, 0.14, 0.05
    drawn = set()
    for seed in range(200):
        tokens, _ = sample(logits.clone(), [SamplingParams(temperature=1.0, min_p=0.5, seed=seed)], [0])
        drawn.add(tokens[0])
    assert drawn == {0, 1}


def defined_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a row is drawn from, by the definitions, with a sort of the whole row:
    temperature, top-k (the k most likely), top-p (a token is dropped when the mass before it, among
    those top-k kept, already reaches top_p), min-p (of what is left), normalized."""
    x = row.double() / p.temperature
    keep = torch.ones_like(x, dtype=torch.bool)
    order = torch.sort(x, descending=True).indices
    if 0 < p.top_k < len(x):
        keep[order[p.top_k:]] = False
    probs = torch.where(keep, x, float("-inf")).softmax(-1)
    sorted_p = probs[order]
    before = sorted_p.cumsum(-1) - sorted_p
    keep[order[before >= p.top_p]] = False
    probs = torch.where(keep, probs, 0.0)
    probs = torch.where(probs < p.min_p * probs.max(), 0.0, probs)
    return probs / probs.sum()


def chi2_within(counts: torch.Tensor, probs: torch.Tensor, n: int) -> tuple[float, float]:
    """Pearson's chi-square of counts against n * probs (expected counts under 5 pooled into one
    cell) and its 99.9% quantile (Wilson–Hilferty)."""
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big].double(), counts[~big].sum(0, keepdim=True).double()])
    exp = torch.cat([expected[big], expected[~big].sum(0, keepdim=True)])
    obs, exp = (obs, exp) if exp[-1] > 0 else (obs[:-1], exp[:-1])
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    df = len(exp) - 1
    return chi2, df * (1 - 2 / (9 * df) + 3.09 * math.sqrt(2 / (9 * df))) ** 3


DRAW_CASES = [
    SamplingParams(temperature=1.0),                              # the whole vocabulary, in blocks
    SamplingParams(temperature=0.6),
    SamplingParams(temperature=1.3, top_k=7),
    SamplingParams(temperature=2.0, top_p=0.9),                   # flat: keeps more than 64 tokens
    SamplingParams(temperature=2.0, top_p=0.999),                 # flatter: more than 512, so all 600 are looked at
    SamplingParams(temperature=0.4, top_p=0.9),                   # peaked: the first 64 hold it
    SamplingParams(temperature=1.0, top_k=40, top_p=0.5),
    SamplingParams(temperature=1.0, min_p=0.3),
    SamplingParams(temperature=0.8, top_k=300, top_p=0.95, min_p=0.02),
]


def test_draws_follow_the_defined_distribution():
    """Every way of narrowing the vocabulary, all in one batch (each row's draw is its own): 4,000
    seeded draws of each case over a 600-token vocabulary (3 blocks of the whole-vocabulary walk, the
    last one short) are distributed as `defined_probs` says, and never a token it gives no
    probability. Seeded, so the test's outcome is fixed."""
    g = torch.Generator().manual_seed(11)
    V, n, per = 600, 4000, 50
    cases = len(DRAW_CASES)
    rows = torch.randn(cases, V, generator=g) * 2.5
    want = [defined_probs(rows[i], p) for i, p in enumerate(DRAW_CASES)]
    kept = [int((w > 0).sum()) for w in want]
    assert kept[3] > TOP_P_CANDIDATES and kept[4] > 8 * TOP_P_CANDIDATES and kept[5] <= TOP_P_CANDIDATES, kept
    counts = torch.zeros(cases, V)
    logits = rows.repeat_interleave(per, dim=0)
    for start in range(0, n, per):
        params = [dataclasses.replace(p, seed=c) for c, p in enumerate(DRAW_CASES) for _ in range(per)]
        tokens, _ = sample(logits.clone(), params, [start + j % per for j in range(cases * per)])
        for j, t in enumerate(tokens):
            counts[j // per, t] += 1
    assert counts.sum() == cases * n
    for case, (c, probs) in enumerate(zip(counts, want)):
        assert c[probs == 0].sum() == 0, f"case {case}: drew a token of zero probability"
        chi2, limit = chi2_within(c, probs, n)
        assert chi2 < limit, f"case {case} {DRAW_CASES[case]}: chi2 {chi2:.1f} over the 99.9% quantile {limit:.1f}"


def test_a_seeded_draw_depends_on_its_row_alone():
    """At the model's vocabulary size (49,152: 192 blocks), a seeded row draws the same token alone and
    in a batch with greedy, unseeded and differently narrowed rows, and again at the same position;
    other positions draw other tokens."""
    g = torch.Generator().manual_seed(12)
    V = 49152
    logits = torch.randn(6, V, generator=g) * 3
    params = [SamplingParams(temperature=0.9, seed=7), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0, top_p=0.9, seed=8), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.7, top_k=50, seed=9), SamplingParams(temperature=1.2, min_p=0.1, seed=10)]
    positions = [3, 0, 5, 1, 2, 9]
    batched, _ = sample(logits.clone(), params, positions)
    for i, p in enumerate(params):
        if p.seed is None:
            continue
        alone = [sample(logits[i:i + 1].clone(), [p], [positions[i]])[0][0] for _ in range(2)]
        assert alone == [batched[i]] * 2, i
    elsewhere = {sample(logits[:1].clone(), params[:1], [pos])[0][0] for pos in range(20)}
    assert len(elsewhere) > 10


def test_a_row_with_no_probability_is_an_error_not_a_token():
    for bad in (float("nan"), float("-inf")):
        for p in (SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.9)):
            with pytest.raises(ValueError, match="no token of positive probability"):
                sample(torch.full((1, V), bad), [p], [0])


def test_invalid_values_are_rejected_with_their_name():
    for kwargs, name in (({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
                         ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"logit_bias": {1: 101.0}}, "logit_bias"),
                         ({"min_p": 1.5}, "min_p"), ({"logprobs": 21}, "logprobs")):
        with pytest.raises(ValueError, match=name):
            SamplingParams(**kwargs)


def engine(spec: str) -> LLMEngine:
    config = EngineConfig(num_kv_blocks=128, max_num_batched_tokens=256, kv_cache_dtype="float32",
                          speculative=SpecConfig(mode=spec))
    return LLMEngine(tiny_model(), tokenizer=None, config=config, model_id="tiny")


def test_engine_penalties_and_logprobs_are_the_same_with_speculation_on_and_off():
    """Penalties look at the output so far, which for a verified row includes the proposals before
    it: the output and its log-probabilities must not depend on speculation."""
    g = torch.Generator().manual_seed(2)
    phrase = torch.randint(0, 97, (6,), generator=g).tolist()
    ps = [phrase * 4, phrase * 3 + [1, 2], torch.randint(0, 97, (20,), generator=g).tolist()]
    params = [SamplingParams(temperature=0.0, max_tokens=24, logprobs=3),  # repeats: speculation accepts
              SamplingParams(temperature=0.0, max_tokens=24, frequency_penalty=0.6, presence_penalty=0.2, logprobs=3),
              SamplingParams(temperature=0.9, seed=5, max_tokens=24, repetition_penalty=1.4, logprobs=2,
                             logit_bias={7: 5.0})]
    results = {}
    for mode in ("off", "ngram"):
        e = engine(mode)
        if mode == "ngram":  # propose at every match: the plan's timing-based choice (a busy machine) could leave
            e.spec.fixed_k = 4  # nothing to accept, and the test would compare two speculation-off runs
        lps: dict[str, list] = {}
        for i, (p, sp) in enumerate(zip(ps, params)):
            e.add_request(str(i), p, sp)
        tokens = {}
        while e.has_unfinished():
            for out in e.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                assert out.logprobs is not None and len(out.logprobs) == len(out.new_token_ids)
                lps.setdefault(out.request_id, []).extend(out.logprobs)
        assert_all_blocks_released(e)
        results[mode] = (tokens, lps)
        if mode == "ngram":
            assert e.spec.stats.num_accepted_tokens > 0
    (t_off, lp_off), (t_on, lp_on) = results["off"], results["ngram"]
    assert t_off == t_on
    for rid in t_off:
        for a, b in zip(lp_off[rid], lp_on[rid]):
            assert a.top_ids == b.top_ids
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
    # and the penalties did something: the penalized greedy request differs from the plain one
    assert t_off["1"] != run_plain(ps[1])


def run_plain(prompt: list[int]) -> list[int]:
    e = engine("off")
    e.add_request("x", prompt, SamplingParams(temperature=0.0, max_tokens=24))
    return run_checked(e)["x"]
