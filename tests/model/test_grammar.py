"""The grammar layer on the real vocabulary, without the model: masks agree with what the matcher
accepts, rollback restores the state, bad constraints name their problem."""

from __future__ import annotations

import json

import pytest

from shared.model.grammar import GrammarCompiler, GrammarError
from shared.model.sampling_params import Constraint
from shared.model.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def compiler(default_gguf) -> GrammarCompiler:
    return GrammarCompiler(Tokenizer.from_gguf(default_gguf))


@pytest.fixture(scope="module")
def tok(compiler) -> Tokenizer:
    return compiler._tokenizer


def test_choices_with_quotes_backslashes_and_non_ascii(compiler, tok):
    choices = ("Zürich", 'say "hi"', "a\\b", "tab\there", "日本")
    for c in choices:
        m = compiler.matcher(Constraint("choice", choices=choices))
        assert m.accept_all(tok.encode(c, add_special_tokens=False)) and m.done
    m = compiler.matcher(Constraint("choice", choices=choices))
    assert not m.accept_all(tok.encode("Zurich", add_special_tokens=False))


def test_mask_matches_acceptance_and_rollback_restores(compiler, tok):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    m = compiler.matcher(Constraint("json", json.dumps(schema)))
    ids = tok.encode('{"n": 42}', add_special_tokens=False)
    start = m.allowed()
    assert start.shape == (compiler.vocab_size,) and 0 < int(start.sum()) < compiler.vocab_size
    assert m.valid_prefix(ids) == len(ids)
    for t in ids:
        assert m.allowed()[t]
        assert m.accept(t)
    assert m.done
    allowed_end = m.allowed().nonzero().flatten().tolist()
    assert set(allowed_end) == set(tok.stop_token_ids)  # complete: only end-of-text
    m.rollback(len(ids))
    assert (m.allowed() == start).all() and not m.done
    bad = tok.encode('{"m": 1}', add_special_tokens=False)
    assert m.valid_prefix(bad) < len(bad)
    assert not m.allowed()[bad[m.valid_prefix(bad)]]


def test_json_is_written_with_fixed_separators(compiler, tok):
    m = compiler.matcher(Constraint("json", ""))
    assert m.accept_all(tok.encode('{"a": [1, 2]}', add_special_tokens=False))
    m = compiler.matcher(Constraint("json", ""))
    assert m.valid_prefix(tok.encode('{\n  "a"', add_special_tokens=False)) < 3  # no free whitespace


@pytest.mark.parametrize("constraint, needle", [
    (Constraint("json", '{"type": "strnig"}'), "strnig"),
    (Constraint("json", "{not json"), "not valid JSON"),
    (Constraint("json", "[1, 2]"), "must be an object"),
    (Constraint("regex", "a(b"), "unclosed group"),
    (Constraint("choice"), "non-empty"),
    (Constraint("yaml", "a: 1"), "unknown constraint kind"),
])
def test_bad_constraints_name_the_problem(compiler, constraint, needle):
    with pytest.raises(GrammarError, match=needle):
        compiler.check(constraint)
    with pytest.raises(GrammarError):
        compiler.matcher(constraint)
