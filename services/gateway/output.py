"""Token ids → the text a client may see now, with stop strings applied exactly as the engine does.

Workers send token ids; the gateway detokenizes (`IncrementalDetokenizer`) and applies the same
stop-string functions as the engine (`shared.model.stop_strings`): cut at a stop string ending in
the new text, and hold back what might still grow into one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.model.stop_strings import find_stop, streamable_len
from shared.model.detokenizer import IncrementalDetokenizer
from shared.model.tokenizer import Tokenizer


@dataclass
class OutputText:
    tokenizer: Tokenizer
    prompt_ids: list[int]
    stop: list[str] = field(default_factory=list)
    min_tokens: int = 0  # like the engine, stop strings are not honoured before this many tokens
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        self._detok = IncrementalDetokenizer(self.tokenizer, self.prompt_ids, self.skip_special_tokens)
        self._text = ""
        self._stop_string: str | None = None
        self._num_tokens = 0
        self._sent = 0  # characters of the text already handed out

    @property
    def text(self) -> str:
        """The whole output text so far (stop string cut away)."""
        return self._text

    @property
    def num_tokens(self) -> int:
        """Tokens taken into the text (none after a stop string matched)."""
        return self._num_tokens

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the text, once one matched."""
        return self._stop_string

    def add(self, token_ids: list[int]) -> str:
        """Append generated tokens; return the text that became safe to send."""
        for token_id in token_ids:
            if self.stop_string is not None:
                break  # cut at a stop string: later tokens (the worker had not stopped yet) are not text
            delta = self._detok.push(token_id)
            self._num_tokens += 1
            self._text += delta
            if self.stop and self._num_tokens >= self.min_tokens:
                found = find_stop(self._text, len(delta), self.stop)
                if found is not None:
                    self._text, self._stop_string = self._text[: found[0]], found[1]
        finished = self._stop_string is not None
        return self._take(streamable_len(self._text, self.stop, finished))

    def finish(self, stop_reason: str | int | None = None) -> str:
        """End of stream: release what was held back; a stop string the worker names cuts the text at
        its first occurrence (the worker matched it; our own match may not have happened yet)."""
        if self.stop_string is None:
            self._text += self._detok.flush()
            if isinstance(stop_reason, str) and stop_reason:
                cut = self._text.find(stop_reason)
                if cut != -1:
                    self._text = self._text[: max(cut, self._sent)]
                    self._stop_string = stop_reason
        return self._take(len(self._text))

    def _take(self, end: int) -> str:
        piece = self._text[self._sent:end]
        self._sent = max(self._sent, end)
        return piece
