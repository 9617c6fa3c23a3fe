"""When a sequence is done, and how much of its text may be streamed yet.

Stop strings are matched on detokenized text. While a stream might still be growing into a stop
string, the last `longest stop − 1` characters are held back, so a client never sees the first half
of a stop string that later gets cut.
"""

from __future__ import annotations

from shared.engine.sequence import FinishReason, Sequence


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
        longest = max(len(s) for s in seq.params.stop)
        # a match must end inside the new text: search from where it could start
        start = max(0, len(seq.text) - new_text_len - longest + 1)
        best = None
        for stop in seq.params.stop:
            idx = seq.text.find(stop, start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return False
        seq.text = seq.text[: best[0]]  # OpenAI semantics: the stop string is not returned
        seq.stop_reason = best[1]
        return True

    @staticmethod
    def streamable_len(seq: Sequence) -> int:
        """How many characters of `seq.text` can be sent now."""
        if seq.is_finished or not seq.params.stop:
            return len(seq.text)
        hold = max(len(s) for s in seq.params.stop) - 1
        return max(0, len(seq.text) - hold)
