"""Token ids → the text a client may see now, with stop strings applied exactly as the engine does.

Workers send token ids; the gateway detokenizes (`IncrementalDetokenizer`) and runs the engine's own
stop-string logic (`shared.engine.stop.StopChecker`) on the result: after each token, look for a stop
string ending in the new text and cut there; while the stream might still be growing into a stop
string, hold back its last `longest stop − 1` characters:

    stop = ["\\n\\nUser"]     text = "Paris.\\n\\nUs"   sent = "Paris."   held = "\\n\\nUs" (might be cut)

StopChecker's helpers read a `Sequence`; `_StopView` is the three attributes of it they use, so the
logic is reused rather than copied (`shared` is not edited from here).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.engine.stop import StopChecker
from shared.model.detokenizer import IncrementalDetokenizer
from shared.model.tokenizer import Tokenizer


@dataclass
class _StopParams:
    stop: list[str]


@dataclass
class _StopView:
    """Duck-typed stand-in for `shared.engine.sequence.Sequence` as StopChecker's helpers use it."""

    params: _StopParams
    text: str = ""
    stop_reason: str | int | None = None
    is_finished: bool = False


@dataclass
class OutputText:
    tokenizer: Tokenizer
    prompt_ids: list[int]
    stop: list[str] = field(default_factory=list)
    min_tokens: int = 0  # like the engine, stop strings are not honoured before this many tokens
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        self._detok = IncrementalDetokenizer(self.tokenizer, self.prompt_ids, self.skip_special_tokens)
        self._view = _StopView(_StopParams(list(self.stop)))
        self._num_tokens = 0
        self._sent = 0  # characters of the text already handed out

    @property
    def text(self) -> str:
        """The whole output text so far (stop string cut away)."""
        return self._view.text

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the text, once one matched."""
        reason = self._view.stop_reason
        return reason if isinstance(reason, str) else None

    def add(self, token_ids: list[int]) -> str:
        """Append generated tokens; return the text that became safe to send."""
        for token_id in token_ids:
            if self.stop_string is not None:
                break  # cut at a stop string: later tokens (the worker had not stopped yet) are not text
            delta = self._detok.push(token_id)
            self._num_tokens += 1
            self._view.text += delta
            if self.stop and self._num_tokens >= self.min_tokens:
                StopChecker._cut_at_stop_string(self._view, len(delta))
        return self._take(StopChecker.streamable_len(self._view) if self.stop_string is None else len(self.text))

    def finish(self, stop_reason: str | int | None = None) -> str:
        """End of stream: release what was held back; a stop string the worker names cuts the text at
        its first occurrence (the worker matched it; our own match may not have happened yet)."""
        if self.stop_string is None:
            self._view.text += self._detok.flush()
            if isinstance(stop_reason, str) and stop_reason:
                cut = self._view.text.find(stop_reason)
                if cut != -1:
                    self._view.text = self._view.text[: max(cut, self._sent)]
                    self._view.stop_reason = stop_reason
        self._view.is_finished = True
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        piece = self._view.text[self._sent:end]
        self._sent = max(self._sent, end)
        return piece
