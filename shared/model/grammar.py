"""Structured output: a `Constraint` compiled into a token-level matcher (llguidance).

The gateway compiles a request's constraint once to reject a bad schema or regex with a 400; the
engine that samples compiles it again into a `Matcher` per sequence, replays the tokens already
generated (a prefill worker's first token, a migrated request's resumed ones), and before every
sample turns the matcher's state into a mask of the tokens allowed next. The state is nothing but
the tokens so far, so it crosses the prefill/decode split and a migration with the tokens.

llguidance was chosen over outlines-core and xgrammar by `benchmarks/bench_grammar_libs.py`
(BENCHMARKS.md): no compile step per schema that grows with the vocabulary, tens of microseconds
per mask on this vocabulary, and no dependencies.

JSON is written with ", " and ": " separators and no other whitespace: free whitespace lets a small
model spend its whole budget on newlines.
"""

from __future__ import annotations

import json
import threading
from typing import TYPE_CHECKING

import llguidance

from shared.model.sampling_params import Constraint
from shared.model.tokenizer import Tokenizer

if TYPE_CHECKING:
    import torch

KINDS = ("json", "regex", "choice", "grammar")
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A constraint that cannot be compiled (an invalid schema, regex or grammar)."""


def grammar_text(constraint: Constraint) -> str:
    """The llguidance grammar (JSON text) a constraint stands for; GrammarError where it is malformed."""
    kind, spec = constraint.kind, constraint.spec
    if kind == "json":
        try:
            schema = json.loads(spec) if spec else {"type": "object"}
        except json.JSONDecodeError as exc:
            raise GrammarError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
        if isinstance(schema, dict):
            schema = {**schema, "x-guidance": {**_JSON_OPTIONS, **schema.get("x-guidance", {})}}
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema)
        except ValueError as exc:
            raise GrammarError(f"invalid JSON schema: {exc}") from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        if not constraint.choices or any(not isinstance(c, str) or not c for c in constraint.choices):
            raise GrammarError("choices must be a non-empty list of non-empty strings")
        # each choice a Lark string literal (JSON's escapes are Lark's; non-ASCII stays as it is)
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in constraint.choices))
    if kind == "grammar":
        return llguidance.LLMatcher.grammar_from_lark(spec)
    raise GrammarError(f"unknown constraint kind {kind!r}; expected one of {KINDS}")


class GrammarCompiler:
    """Compiles constraints against one tokenizer (the vocabulary is indexed once, on first use)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int | None = None) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size or tokenizer.vocab_size  # the model's logits width (≥ the tokenizer's)
        self._ll: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll is None:
                self._ll = llguidance.LLTokenizer(self._tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                                  eos_token=sorted(self._tokenizer.stop_token_ids))
            return self._ll

    def check(self, constraint: Constraint) -> None:
        """Raise GrammarError naming the problem where `constraint` cannot be compiled."""
        error = llguidance.LLMatcher.validate_grammar(grammar_text(constraint), self.ll_tokenizer)
        if error:
            raise GrammarError(_one_line(error))

    def matcher(self, constraint: Constraint) -> Matcher:
        m = llguidance.LLMatcher(self.ll_tokenizer, grammar_text(constraint), log_level=0)
        if m.is_error():
            raise GrammarError(_one_line(m.get_error()))
        return Matcher(m, self.vocab_size)


class Matcher:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        import torch  # here: the gateway compiles grammars (to check them) and never imports torch

        self._m = matcher
        self._words = torch.empty(1, (vocab_size + 31) // 32, dtype=torch.int32)
        self._bits = torch.arange(32, dtype=torch.int32)
        self.vocab_size = vocab_size

    def allowed(self) -> torch.Tensor:
        """[V] bool: the tokens the grammar allows next (the end-of-text tokens once it is complete)."""
        row = self._words[0]
        self._m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
        return ((row.unsqueeze(-1) >> self._bits) & 1).view(-1)[:self.vocab_size].bool()

    def accept(self, token: int) -> bool:
        """Advance by one token; False (and the matcher stops) where the grammar does not allow it."""
        return self._m.consume_token(token)

    def accept_all(self, tokens: list[int]) -> bool:
        return self._m.consume_tokens(tokens)

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` the grammar accepts in a row from here (the state is unchanged)."""
        return self._m.validate_tokens(tokens)

    def rollback(self, n: int) -> None:
        if n:
            self._m.rollback(n)

    @property
    def done(self) -> bool:
        """Nothing but end-of-text may follow: the text is complete (or the matcher failed)."""
        return self._m.is_stopped()

    @property
    def error(self) -> str:
        return self._m.get_error()


def _one_line(message: str, limit: int = 400) -> str:
    """llguidance's multi-line error (a caret under the spot, then the reason) as one line."""
    text = " ".join(line.strip() for line in message.strip().splitlines() if line.strip() and line.strip() != "^")
    return text if len(text) <= limit else text[:limit - 1] + "…"
