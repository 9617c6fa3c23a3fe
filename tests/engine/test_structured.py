"""Structured output through the engine with the real model: every completion of 34 JSON schemas
parses and validates, greedy and sampled, with speculation on (the default) and off, colocated and
across the prefill/decode split; regex, choice and grammar constraints; bad constraints rejected."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from shared.config import EngineConfig, SpecConfig
from shared.engine.engine import LLMEngine, RequestError
from shared.model.sampling_params import Constraint, SamplingParams
from tests.data.json_schemas import SCHEMAS
from tests.engine.test_generate_real_model import chat_ids

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(default_gguf):
    """The default configuration (speculation on: suffix proposals, which repeat earlier answers)."""
    return LLMEngine.from_config(EngineConfig(model=str(default_gguf), num_kv_blocks=1024))


@pytest.fixture(scope="module")
def plain_engine(default_gguf):
    return LLMEngine.from_config(EngineConfig(model=str(default_gguf), num_kv_blocks=1024,
                                              speculative=SpecConfig(mode="off")))


def json_chat_ids(engine, question: str) -> list[int]:
    return chat_ids(engine, f"{question} Answer in JSON.")


def json_params(schema: dict, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=200, constraint=Constraint("json", json.dumps(schema)), **kw)


def check_all_valid(outs) -> list[str]:
    for (name, _, schema), out in zip(SCHEMAS, outs):
        assert out.finish_reason == "stop", (name, out.text)
        jsonschema.validate(json.loads(out.text), schema)
    return [out.text for out in outs]


def test_every_schema_greedy_validates_and_speculation_changes_nothing(engine, plain_engine):
    assert len(SCHEMAS) >= 30
    prompts = [json_chat_ids(engine, q) for _, q, _ in SCHEMAS]
    params = [json_params(s, temperature=0.0) for _, _, s in SCHEMAS]
    plain = check_all_valid(plain_engine.generate(prompts, params))
    first = check_all_valid(engine.generate(prompts, params))
    again = engine.generate(prompts, params)  # now the suffix cache proposes whole earlier answers
    assert check_all_valid(again) == first == plain
    assert engine.spec.stats.num_accepted_tokens > 0
    for e in (engine, plain_engine):
        e.pool.check_invariants()
        assert e.pool.num_used_blocks == 0


def test_every_schema_sampled_validates(engine):
    prompts = [json_chat_ids(engine, q) for _, q, _ in SCHEMAS]
    outs = engine.generate(prompts, [json_params(s, temperature=1.0, seed=i) for i, (_, _, s) in enumerate(SCHEMAS)])
    texts = check_all_valid(outs)
    assert len(set(texts)) > len(texts) // 2  # sampling, not one answer


def test_constraint_crosses_the_prefill_decode_split(engine, plain_engine):
    cases = SCHEMAS[:6]
    prompts = [json_chat_ids(engine, q) for _, q, _ in cases]
    params = [json_params(s, temperature=0.7, seed=7) for _, _, s in cases]
    colocated = plain_engine.generate(prompts, params)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        plain_engine.add_request(f"p{i}", p, sp, prefill_only=True)
    firsts = {}
    while plain_engine.has_unfinished():
        for out in plain_engine.step():
            firsts[out.request_id] = out.new_token_ids[0]
    for i, (p, sp) in enumerate(zip(prompts, params)):
        _, blocks = plain_engine.export_kv(f"p{i}")
        engine.add_prefilled(f"d{i}", p, firsts[f"p{i}"], blocks, sp)
    got: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    for i, out in enumerate(colocated):
        assert [firsts[f"p{i}"]] + got[f"d{i}"] == out.new_token_ids


def test_a_migrated_request_resumes_inside_its_grammar(plain_engine):
    """The resumed tokens (the tail of the prompt on the new worker) advance the matcher first."""
    _, q, schema = SCHEMAS[0]
    prompt = json_chat_ids(plain_engine, q)
    params = json_params(schema, temperature=0.0)
    [whole] = plain_engine.generate([prompt], params)
    k = 5
    plain_engine.add_request("moved", prompt + whole.new_token_ids[:k], params, num_resumed=k)
    rest: list[int] = []
    while plain_engine.has_unfinished():
        for out in plain_engine.step():
            rest.extend(out.new_token_ids)
    assert whole.new_token_ids[:k] + rest == whole.new_token_ids


def test_regex_choice_and_grammar(engine):
    cases = [
        ("Give me a phone number.", Constraint("regex", r"[0-9]{3}-[0-9]{4}"), r"[0-9]{3}-[0-9]{4}"),
        ("What is the capital of France?", Constraint("choice", choices=("Paris", "London", "Berlin")),
         r"Paris|London|Berlin"),
        ("Say hello.", Constraint("grammar", 'start: greeting " " name\ngreeting: "hello" | "hi"\nname: /[a-z]{1,8}/'),
         r"(hello|hi) [a-z]{1,8}"),
    ]
    for temperature in (0.0, 1.0):
        outs = engine.generate([json_chat_ids(engine, q) for q, _, _ in cases],
                               [SamplingParams(max_tokens=40, temperature=temperature, seed=1, constraint=c)
                                for _, c, _ in cases])
        for (_, _, pattern), out in zip(cases, outs):
            assert re.fullmatch(pattern, out.text), (pattern, out.text)
            assert out.finish_reason == "stop"


def test_a_bad_constraint_is_a_request_error(plain_engine):
    for c in (Constraint("json", '{"type": "strnig"}'), Constraint("json", "{not json"),
              Constraint("regex", "a(b"), Constraint("grammar", "start: nothing_defined"),
              Constraint("choice"), Constraint("xml", "<a/>")):
        with pytest.raises(RequestError):
            plain_engine.add_request("bad", [1, 2, 3], SamplingParams(constraint=c))
        assert "bad" not in plain_engine.seqs
    plain_engine.add_request("bad", [1, 2, 3], SamplingParams(max_tokens=2))  # the id is free again
    plain_engine.abort("bad")
