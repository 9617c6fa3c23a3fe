"""Seeded request traces. Request `i` of a workload depends only on (seed, workload, i), so a trace
is the same however many requests a run takes, and every system under test gets the identical one.

Prompts are generated English-like text (seeded words in sentences); nothing is downloaded. Their
token length is approximate (TOKENS_PER_WORD, measured on SmolLM2's tokenizer for this word list)
unless a tokenizer is given, which makes it exact for that tokenizer.

    chat           100–300-token prompts, 128–256 output tokens
    long-doc       1,500–3,000-token prompts, 32–128 output tokens
    shared-prefix  one ~1,200-token prefix shared by every request + a distinct 20–60-token question
    doc-qa         reuse-heavy: `users` users, each with its own ~1,200-token document (--prefix-len),
                   asking question after question (request i: user i mod users) of 20–60 tokens
    interference   chat streams at fixed concurrency while long-doc prompts arrive (see runner.py)
    grounded       answers that reuse their prompt (speculative decoding's case), in turn: a code edit
                   that returns the given function, a summary that quotes the given text, records
                   extracted as JSON lines; 64–160 output tokens
    open           free chat: a short open question, 128–256 output tokens
    dataset        a JSONL file: {"prompt": ..., "max_tokens": ...} per line, taken in order, cycled
"""

from __future__ import annotations

import builtins
import json
import keyword
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

WORKLOADS = ("chat", "long-doc", "shared-prefix", "doc-qa", "interference", "grounded", "open")

# Measured with SmolLM2-135M's tokenizer on text from `TextGenerator` (1.10 tokens/word: most of
# these words are one token, a space included; the full stops and a few rarer words add the rest).
TOKENS_PER_WORD = 1.10

_WORDS = """the of and to in is that for it as was with be by on not he this are or his from at which but have
an they you were her she there been one all we their has would when if so no what up out them about more
time only new some could these two may first then do any like my now over such our man me even most made
after also did many before must through back years where much your way well down should because each just
those people how too little state good very make world still own see men work long get here between both
life being under never day same another know while last might us great old year off come since against
go came right used take three small house water city river garden market school table window letter
morning evening light stone road field bridge train music story paper island forest mountain village
harbour engine bread summer winter autumn spring question answer number family friend history reason
system company country problem service member place point hand part child eye woman week case group
fact idea report level office door health person art war party result change moment air teacher force
education foot boy age policy process music book room area money night family minute sense plan voice
careful quiet simple bright early open green heavy clear strong warm empty narrow ancient modern gentle
walk read write build carry follow listen travel remember explain describe measure gather repair""".split()

CHAT_PROMPT_TOKENS = (100, 300)
CHAT_OUTPUT_TOKENS = (128, 256)
LONG_PROMPT_TOKENS = (1500, 3000)
LONG_OUTPUT_TOKENS = (32, 128)
SHARED_PREFIX_TOKENS = 1200
SUFFIX_TOKENS = (20, 60)
SHARED_PREFIX_OUTPUT_TOKENS = (16, 48)
GROUNDED_PROMPT_TOKENS = (80, 200)
GROUNDED_OUTPUT_TOKENS = (64, 160)
OPEN_PROMPT_TOKENS = (8, 24)
OPEN_OUTPUT_TOKENS = (128, 256)

_NAMES = "alice bob carol dave erin frank grace heidi ivan judy mallory niaj olivia peggy rupert sybil".split()
_CITIES = "paris berlin madrid rome lisbon vienna prague oslo dublin athens warsaw zurich".split()
_OPEN = ["Tell me about", "Write a short story about", "Explain", "What do you think of", "Describe",
         "Give me advice on", "Write a poem about"]
_TOPICS = """a river in winter|the history of bread|learning music as an adult|a harbour town|how bridges stand up|
a forest at night|the first train journey|keeping a garden|why cities grow|an old stone house|a mountain village|
the school of the future|writing letters|the sea in autumn|a quiet morning|friendship|the market on a Saturday|
building a table|a long walk|the light in summer|an island nobody visits|remembering a teacher|a family recipe|
the engine of a ship|modern art|the evening sky|a small company|travel on a budget|an ancient road|health and sleep""".replace(
    "\n", "").split("|")
_IDENTIFIERS = [w for w in _WORDS if w.isidentifier() and not keyword.iskeyword(w) and w not in dir(builtins)]


@dataclass(frozen=True)
class RequestSpec:
    index: int
    kind: str  # "chat" | "long" | "shared-prefix" | "doc-qa" | "dataset"
    prompt: str
    max_tokens: int
    prompt_tokens: int  # the intended length (exact with a tokenizer, else approximate)


class TextGenerator:
    """Sentences of seeded random words, about `n` tokens long (exactly, given a tokenizer's count)."""

    def __init__(self, count_tokens: Callable[[str], int] | None = None):
        self.count_tokens = count_tokens

    def text(self, rng: random.Random, n_tokens: int) -> str:
        words: list[str] = []
        target_words = max(1, round(n_tokens / TOKENS_PER_WORD))
        while len(words) < target_words:
            words += self._sentence(rng)
        words = words[:target_words]
        if self.count_tokens is None:
            return " ".join(words)
        while self.count_tokens(" ".join(words)) < n_tokens:  # too short: extend, then trim below
            words += self._sentence(rng)
        lo, hi = 1, len(words)  # the longest prefix of words within n_tokens
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.count_tokens(" ".join(words[:mid])) <= n_tokens:
                lo = mid
            else:
                hi = mid - 1
        return " ".join(words[:lo])

    @staticmethod
    def _sentence(rng: random.Random) -> list[str]:
        words = rng.choices(_WORDS, k=rng.randint(6, 14))
        words[0] = words[0].capitalize()
        words[-1] += "."
        return words


def _rng(seed: int, name: str, index: int) -> random.Random:
    return random.Random(f"{seed}:{name}:{index}")  # str seeds hash with sha512: stable across runs


def _pick(rng: random.Random, bounds: tuple[int, int]) -> int:
    return rng.randint(bounds[0], bounds[1])


class Workload:
    """Request i of a named, seeded workload. Length ranges can be overridden (inclusive bounds)."""

    def __init__(self, name: str, seed: int = 0, *, prompt_tokens: tuple[int, int] | None = None,
                 output_tokens: tuple[int, int] | None = None, prefix_tokens: int = SHARED_PREFIX_TOKENS,
                 text: TextGenerator | None = None, users: int = 8):
        defaults = {"chat": (CHAT_PROMPT_TOKENS, CHAT_OUTPUT_TOKENS), "long-doc": (LONG_PROMPT_TOKENS, LONG_OUTPUT_TOKENS),
                    "shared-prefix": (SUFFIX_TOKENS, SHARED_PREFIX_OUTPUT_TOKENS),
                    "doc-qa": (SUFFIX_TOKENS, SHARED_PREFIX_OUTPUT_TOKENS),
                    "grounded": (GROUNDED_PROMPT_TOKENS, GROUNDED_OUTPUT_TOKENS),
                    "open": (OPEN_PROMPT_TOKENS, OPEN_OUTPUT_TOKENS)}
        if name not in defaults:
            raise ValueError(f"unknown workload {name!r} (one of {', '.join(defaults)})")
        self.name, self.seed = name, seed
        self.prompt_tokens = _check_range(prompt_tokens or defaults[name][0], "prompt tokens")
        self.output_tokens = _check_range(output_tokens or defaults[name][1], "output tokens")
        self.text = text or TextGenerator()
        self.prefix_tokens = prefix_tokens
        if users < 1:
            raise ValueError(f"users must be >= 1, got {users}")
        self.users = users
        self._prefix: str | None = None
        self._docs: dict[int, str] = {}

    def request(self, index: int) -> RequestSpec:
        rng = _rng(self.seed, self.name, index)
        n_prompt, n_out = _pick(rng, self.prompt_tokens), _pick(rng, self.output_tokens)
        if self.name == "grounded":
            return RequestSpec(index, "grounded", self._grounded(rng, index, n_prompt), n_out, n_prompt)
        if self.name == "open":
            return RequestSpec(index, "open", f"{rng.choice(_OPEN)} {rng.choice(_TOPICS)}.", n_out, n_prompt)
        body = self.text.text(rng, n_prompt)
        if self.name == "chat":
            return RequestSpec(index, "chat", f"{body}\nWrite a long answer about the text above.", n_out, n_prompt)
        if self.name == "long-doc":
            return RequestSpec(index, "long", f"Document:\n{body}\nSummarise the document above.", n_out, n_prompt)
        if self.name == "doc-qa":
            user = index % self.users
            prompt = f"{self.document(user)}\nQuestion {index // self.users}: {body}"
            return RequestSpec(index, "doc-qa", prompt, n_out, self.prefix_tokens + n_prompt)
        prompt = f"{self.shared_prefix()}\nQuestion {index}: {body}"
        return RequestSpec(index, "shared-prefix", prompt, n_out, self.prefix_tokens + n_prompt)

    def _grounded(self, rng: random.Random, index: int, n_tokens: int) -> str:
        kind = index % 3
        if kind == 0:  # a code edit: most of the function comes back
            fn, old, new = rng.sample(_IDENTIFIERS, 2) + [rng.choice(_IDENTIFIERS) + "_value"]
            lines = [f"def {fn}_{index}(items, {old}):", f'    """Return the {rng.choice(_WORDS)} of the items."""',
                     "    total = 0"]
            while len(" ".join(lines).split()) * 1.6 < n_tokens:
                a, b = rng.sample(_IDENTIFIERS, 2)
                lines += [f"    for {a} in items:", f"        if {a} > {old}:", f"            total += {a} * {len(lines)}",
                          f"        {b} = total - {old}"]
            lines.append(f"    return total + {old}")
            code = "\n".join(lines)
            return f"{code}\n\nRename the parameter `{old}` to `{new}` and return the whole function."
        if kind == 1:  # a summary that quotes the given text
            body = self.text.text(rng, n_tokens)
            return f"{body}\n\nSummarise the text above, quoting its sentences word for word."
        rows = []  # structured extraction
        while len(" ".join(rows).split()) * 1.5 < n_tokens:
            rows.append(f"{rng.choice(_NAMES).capitalize()} lives in {rng.choice(_CITIES).capitalize()} and is "
                        f"{rng.randint(18, 90)} years old.")
        return " ".join(rows) + '\n\nList every person above as JSON lines {"name": ..., "city": ..., "age": ...}.'

    def document(self, user: int) -> str:
        """User `user`'s own document (doc-qa): the prefix every one of their questions repeats."""
        if user not in self._docs:
            body = self.text.text(_rng(self.seed, "doc", user), self.prefix_tokens)
            self._docs[user] = f"Document of user {user}.\n{body}\nEnd of the document."
        return self._docs[user]

    def shared_prefix(self) -> str:
        if self._prefix is None:
            body = self.text.text(_rng(self.seed, "prefix", 0), self.prefix_tokens)
            self._prefix = f"You are given the following reference document.\n{body}\nEnd of the document."
        return self._prefix


class Dataset:
    """Requests from a JSONL file ({"prompt": str, "max_tokens": int?}), in file order, cycled."""

    def __init__(self, path: str | Path, default_max_tokens: int = 128):
        self.rows: list[tuple[str, int]] = []
        for n, line in enumerate(Path(path).read_text().splitlines(), 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row.get("prompt"), str):
                raise ValueError(f"{path}:{n}: each line needs a string 'prompt'")
            self.rows.append((row["prompt"], int(row.get("max_tokens", default_max_tokens))))
        if not self.rows:
            raise ValueError(f"{path}: no requests in the dataset")
        self.name = "dataset"

    def request(self, index: int) -> RequestSpec:
        prompt, max_tokens = self.rows[index % len(self.rows)]
        return RequestSpec(index, "dataset", prompt, max_tokens, round(len(prompt.split()) * TOKENS_PER_WORD))


def poisson_offsets(rate: float, seed: int) -> Iterator[float]:
    """Send times (s from the start) of a Poisson process at `rate` req/s; rate inf: all at 0."""
    rng = random.Random(f"{seed}:arrivals:{rate}")
    t = 0.0
    while True:
        yield t
        if rate != float("inf"):
            t += rng.expovariate(rate)


def parse_range(text: str) -> tuple[int, int]:
    """'128' → (128, 128); '100-300' → (100, 300)."""
    lo, _, hi = text.partition("-")
    return _check_range((int(lo), int(hi or lo)), text)


def _check_range(bounds: tuple[int, int], what: str) -> tuple[int, int]:
    lo, hi = bounds
    if not 1 <= lo <= hi:
        raise ValueError(f"{what}: need 1 <= min <= max, got {lo}-{hi}")
    return lo, hi


def tokenizer_counter(path: str) -> Callable[[str], int]:
    """Token counter of a GGUF file or Hugging Face model directory (no special tokens)."""
    from shared.model.tokenizer import Tokenizer

    tok = Tokenizer.from_model(path)
    return lambda text: len(tok.encode(text, add_special_tokens=False))
