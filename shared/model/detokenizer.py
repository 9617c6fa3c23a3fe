"""Turn a stream of generated token ids into a stream of text deltas, one `push` per token.

Decoding token by token does not work: a byte-level BPE token can be half of a UTF-8 character
(🇫🇷 is 6 tokens), and decoders such as SentencePiece's drop a leading space on the first token of
whatever they are given. So, like vLLM, we decode a short sliding window twice, with and without the
unread tokens, and emit the difference:

    window:  [ t0  t1 | t2  t3 ]          prefix_text = decode(t0 t1)      (already emitted)
              └prefix┘ └unread┘           new_text    = decode(t0 t1 t2 t3)
                                           delta       = new_text[len(prefix_text):]

The prefix gives the decoder the same left context the full sequence has. A delta is held back while
`new_text` ends in U+FFFD (the last character is still incomplete) or adds nothing (e.g. a skipped
special token); once emitted, the unread tokens become the next prefix. The window therefore spans
the last emitted chunk plus the held tokens (a handful), so each push costs O(1), and the deltas
concatenate to exactly `decode(generated_ids)`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

log = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"  # what a decoder gives for bytes that are not (yet) a whole UTF-8 character
PROMPT_CONTEXT_TOKENS = 5  # prompt tokens seeded into the first window, as vLLM does


class _Decoder(Protocol):
    vocab_size: int

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...


class IncrementalDetokenizer:
    """Text deltas for one sequence: `push` each generated id, `flush` at the end of the stream."""

    def __init__(
        self, tokenizer: _Decoder, prompt_ids: Sequence[int] | None = None, skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # The prompt's tail is left context only, so a SentencePiece-style decoder keeps the leading
        # space of the first generated word. It must end on a whole character, or the first delta
        # would start inside it; a prompt from encode() always does, raw ids might not.
        context = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:]) if prompt_ids else []
        prefix_text = self._decode(context)
        if prefix_text.endswith(REPLACEMENT_CHAR):
            log.debug("prompt ends inside a character; detokenizing without prompt context")
            context, prefix_text = [], ""
        self._window: list[int] = context
        self._num_read = len(context)  # window[:num_read] is the prefix, window[num_read:] is unread
        self._prefix_text = prefix_text
        self._chunks: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._chunks)

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text it completes ("" while a character is pending)."""
        if isinstance(token_id, bool) or not 0 <= token_id < self._tokenizer.vocab_size:
            raise ValueError(f"token id {token_id!r} is outside the vocabulary (size {self._tokenizer.vocab_size})")
        self._window.append(int(token_id))
        new_text = self._decode(self._window)
        if len(new_text) <= len(self._prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        return self._emit(new_text)

    def flush(self) -> str:
        """End of stream: emit whatever is held, incomplete characters included (as `decode` shows them)."""
        if self._num_read == len(self._window):
            return ""
        return self._emit(self._decode(self._window))

    def _emit(self, new_text: str) -> str:
        delta = new_text[len(self._prefix_text) :]
        # Slide: the unread tokens become the prefix of the next window.
        self._window = self._window[self._num_read :]
        self._num_read = len(self._window)
        self._prefix_text = self._decode(self._window)
        if delta:
            self._chunks.append(delta)
        return delta

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens) if ids else ""
