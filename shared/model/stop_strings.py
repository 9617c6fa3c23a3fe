"""Stop strings on streamed text, shared by the engine (which ends the sequence) and the gateway
(which cuts the text it streams). Pure text: no torch.

A match must end inside the text added last; while the text might still grow into a stop string,
its last `longest stop − 1` characters are held back from the client:

    stops = ["\\n\\nUser"]    text = "Paris.\\n\\nUs"    streamable = "Paris."    held = "\\n\\nUs"
"""

from __future__ import annotations


def find_stop(text: str, new_text_len: int, stops: list[str]) -> tuple[int, str] | None:
    """The earliest stop string that ends in the last `new_text_len` characters: (start, stop)."""
    if not stops:
        return None
    start = max(0, len(text) - new_text_len - max(len(s) for s in stops) + 1)
    best = None
    for stop in stops:
        idx = text.find(stop, start)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    return best


def streamable_len(text: str, stops: list[str], finished: bool) -> int:
    """How many characters of `text` may be sent now."""
    if finished or not stops:
        return len(text)
    return max(0, len(text) - (max(len(s) for s in stops) - 1))
