"""Log-probabilities in OpenAI's two shapes, from the workers' per-token `TokenLogprobs`.

    chat:         {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}
    completions:  {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob}], "text_offset": [...]}

A token's string is its text where its bytes are whole UTF-8, else "bytes:\\xNN…" (as vLLM writes
a piece of a character); "bytes" always holds the exact bytes. A log-probability of -inf (a token
the request banned) is written as -9999.0, JSON having no infinity. `text_offset` counts the
characters of the output before each token.
"""

from __future__ import annotations

import codecs
import math
from typing import Any

from shared.model.tokenizer import Tokenizer
from shared.protocol.messages import TokenLogprobs

NEG_INF_LOGPROB = -9999.0


def _value(x: float) -> float:
    return x if math.isfinite(x) else NEG_INF_LOGPROB


class LogprobFormat:
    """Formats one request's log-probabilities, chunk after chunk (completions keep a text offset)."""

    def __init__(self, tokenizer: Tokenizer, kind: str) -> None:
        self.tokenizer, self.kind = tokenizer, kind
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._offset = 0

    def fresh(self) -> LogprobFormat:
        """A formatter for another choice of the request (its own text offset)."""
        return LogprobFormat(self.tokenizer, self.kind)

    def token(self, token_id: int) -> tuple[str, bytes]:
        data = self.tokenizer.token_bytes(token_id)
        try:
            return data.decode(), data
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in data), data

    def format(self, tokens: list[tuple[int, TokenLogprobs]]) -> dict[str, Any] | None:
        """The `logprobs` field of a choice for these tokens (None when there are none)."""
        if not tokens:
            return None
        return self._chat(tokens) if self.kind == "chat" else self._completion(tokens)

    def format_prompt(self, prompt_ids: list[int], logprobs: list[TokenLogprobs]) -> dict[str, Any]:
        """Completions' echo: the prompt's tokens, the first without a log-probability (None), as
        vLLM and OpenAI write it; the output's offsets then continue after the prompt's text."""
        return self._completion(list(zip(prompt_ids[1:], logprobs)), first=prompt_ids[0])

    def _chat(self, tokens: list[tuple[int, TokenLogprobs]]) -> dict[str, Any]:
        content = []
        for token_id, lp in tokens:
            text, data = self.token(token_id)
            top = []
            for tid, v in zip(lp.top_ids, lp.top_logprobs):
                t, d = self.token(tid)
                top.append({"token": t, "logprob": _value(v), "bytes": list(d)})
            content.append({"token": text, "logprob": _value(lp.logprob), "bytes": list(data), "top_logprobs": top})
        return {"content": content}

    def _completion(self, tokens: list[tuple[int, TokenLogprobs]], first: int | None = None) -> dict[str, Any]:
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        if first is not None:  # a token with nothing before it: no log-probability
            text, data = self.token(first)
            out["tokens"].append(text)
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            out["text_offset"].append(self._offset)
            self._offset += len(self._decoder.decode(data))
        for token_id, lp in tokens:
            text, data = self.token(token_id)
            out["tokens"].append(text)
            out["token_logprobs"].append(_value(lp.logprob))
            top: dict[str, float] = {}
            for tid, v in zip(lp.top_ids, lp.top_logprobs):
                top.setdefault(self.token(tid)[0], _value(v))  # two ids of one string: the likelier one
            out["top_logprobs"].append(top)
            out["text_offset"].append(self._offset)
            self._offset += len(self._decoder.decode(data))
        return out


def join(parts: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """Several chunks' `logprobs` as one (for a non-streamed response)."""
    parts = [p for p in parts if p]
    if not parts:
        return None
    return {key: [x for p in parts for x in p[key]] for key in parts[0]}
