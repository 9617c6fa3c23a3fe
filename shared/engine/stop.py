"""When a sequence is done, and how much of its text may be streamed yet (stop strings: see
shared/model/stop_strings.py, which the gateway uses too)."""

from __future__ import annotations

from shared.engine.sequence import FinishReason, Sequence
from shared.model.stop_strings import find_stop, streamable_len


class StopChecker:
    def __init__(self, eos_token_ids: set[int], max_model_len: int):
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def check(self, seq: Sequence, new_text_len: int) -> FinishReason | None:
        """Called after a token is appended (and its text added to `seq.text`, `new_text_len` long)."""
        params = seq.params
        token = seq.output_ids[-1]
        num_out = len(seq.output_ids)
        if num_out >= params.min_tokens:
            if token in params.stop_token_ids:
                seq.stop_reason = token
                return FinishReason.STOP
            if not params.ignore_eos and token in self.eos_token_ids:
                seq.stop_reason = None
                return FinishReason.STOP
            if params.stop and self._cut_at_stop_string(seq, new_text_len):
                return FinishReason.STOP
        if num_out >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    @staticmethod
    def _cut_at_stop_string(seq: Sequence, new_text_len: int) -> bool:
        found = find_stop(seq.text, new_text_len, seq.params.stop)
        if found is None:
            return False
        seq.text = seq.text[: found[0]]  # OpenAI semantics: the stop string is not returned
        seq.stop_reason = found[1]
        return True

    @staticmethod
    def streamable_len(seq: Sequence) -> int:
        """How many characters of `seq.text` can be sent now."""
        return streamable_len(seq.text, seq.params.stop, seq.is_finished)
