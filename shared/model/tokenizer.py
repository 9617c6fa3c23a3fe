"""Text ⇄ token ids: a Hugging Face `tokenizers` byte-level BPE, built from GGUF metadata or tokenizer.json.

GGUF files carry the tokenizer as plain metadata (vocab list, merges, token types, special ids,
llama.cpp's pre-tokenizer name). `Tokenizer.from_gguf_metadata` turns those values into the same
`tokenizers.Tokenizer` that the checkpoint's tokenizer.json would give, so both sources behave alike.

The pre-tokenizer is the part that must match exactly: llama.cpp names a regex set (`tokenizer.ggml.pre`)
and we map it to the HF pre-tokenizer chain that splits text the same way. For 'smollm' (shared with
starcoder, refact, command-r, ...) llama.cpp runs two regexes in turn:

    "\\p{N}"                                    -> every digit is its own piece
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"   -> GPT-2's split

which is HF's Sequence([Digits(individual_digits=True), ByteLevel(use_regex=True)]), the chain in
SmolLM2's own tokenizer.json.
"""

from __future__ import annotations

import json
import logging
import operator
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, decoders, pre_tokenizers, processors

from shared.model.gguf_file import read_gguf_metadata

log = logging.getLogger(__name__)

TOKEN_TYPE_CONTROL = 3  # gguf.TokenType.CONTROL: <|im_start|> and friends, hidden by skip_special_tokens
TOKEN_TYPE_USER_DEFINED = 4  # gguf.TokenType.USER_DEFINED: added tokens that are ordinary text

# Tokens that end an assistant turn in common chat formats; stop on them too when they are special.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>")

_GPT2_REGEX_FAMILY = ("gpt-2", "mpt", "olmo", "jais")
_DIGITS_THEN_GPT2_FAMILY = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone")
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _pre_tokenizer(pre: str) -> tuple[pre_tokenizers.PreTokenizer, bool]:
    """HF pre-tokenizer for llama.cpp's `tokenizer.ggml.pre` name, and the BPE `ignore_merges` flag."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre in _DIGITS_THEN_GPT2_FAMILY:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level]), False
    if pre in _GPT2_REGEX_FAMILY:
        return byte_level, False
    if pre == "llama-bpe":  # Llama 3: its own split regex, then bytes only; whole-word vocab hits win
        split = pre_tokenizers.Split(tokenizers.Regex(_LLAMA3_SPLIT), behavior="isolated", invert=False)
        plain_bytes = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)
        return pre_tokenizers.Sequence([split, plain_bytes]), True
    supported = sorted(_DIGITS_THEN_GPT2_FAMILY + _GPT2_REGEX_FAMILY + ("llama-bpe",))
    raise ValueError(f"GGUF pre-tokenizer tokenizer.ggml.pre={pre!r} is not supported (supported: {supported})")


def _gguf_backend(meta: Mapping[str, Any]) -> tuple[tokenizers.Tokenizer, list[str]]:
    """The BPE model, pre-tokenizer, decoder and added tokens that GGUF metadata describes."""
    model = meta.get("tokenizer.ggml.model")
    if model is None:
        raise ValueError("GGUF metadata has no tokenizer.ggml.model: the file carries no tokenizer")
    if model != "gpt2":
        kind = {"llama": "SentencePiece", "bert": "WordPiece", "t5": "Unigram"}.get(model, "unknown kind")
        raise ValueError(f"GGUF tokenizer model {model!r} ({kind}) is not supported; only 'gpt2' byte-level BPE is")
    tokens = _need_list(meta, "tokenizer.ggml.tokens", str)
    merges = _need_list(meta, "tokenizer.ggml.merges", str)
    types = meta.get("tokenizer.ggml.token_type")
    if types is None:
        log.warning("GGUF has no tokenizer.ggml.token_type: no special tokens will be recognised in text")
        types = [1] * len(tokens)
    elif len(types) != len(tokens):
        raise ValueError(f"tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    pre = meta.get("tokenizer.ggml.pre")
    if pre is None:
        raise ValueError("GGUF metadata has no tokenizer.ggml.pre: cannot tell how to split text")
    pre_tokenizer, ignore_merges = _pre_tokenizer(pre)

    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        # Keep the first id of a repeated string, as HF's vocab.json would; later copies decode to "".
        log.warning("GGUF vocab repeats %d token strings; keeping the first id of each", len(tokens) - len(vocab))
        vocab = {}
        for i, tok in enumerate(tokens):
            vocab.setdefault(tok, i)
    pairs = []
    for merge in merges:
        cut = merge.find(" ", 1)  # from 1, as llama.cpp does: a piece may itself start with a space
        if cut < 0:
            raise ValueError(f"tokenizer.ggml.merges entry {merge!r} is not two pieces joined by a space")
        pairs.append((merge[:cut], merge[cut + 1 :]))
    try:
        bpe = tokenizers.models.BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges)
    except Exception as exc:  # the Rust side raises a bare Exception, e.g. for a merge of unknown pieces
        raise ValueError(f"GGUF vocab and merges do not form a BPE model: {exc}") from exc

    backend = tokenizers.Tokenizer(bpe)
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    # Added tokens match as whole strings before BPE runs, so "<|im_start|>" in text is one id.
    control = [tokens[i] for i, t in enumerate(types) if t == TOKEN_TYPE_CONTROL]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    # User-defined tokens match whole too, but they are ordinary text: skip_special_tokens keeps them.
    user = [tokens[i] for i, t in enumerate(types) if t == TOKEN_TYPE_USER_DEFINED]
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    return backend, tokens


class Tokenizer:
    """Encode/decode plus the special ids the server needs (bos, eos, stop set, chat template)."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        pad_token_id: int | None = None,
        unk_token_id: int | None = None,
        extra_stop_ids: Iterable[int] = (),
        chat_template: str | None = None,
    ) -> None:
        self._backend = backend
        self._vocab_size = backend.get_vocab_size(with_added_tokens=True)
        for name, value in (("bos", bos_token_id), ("eos", eos_token_id), ("pad", pad_token_id), ("unk", unk_token_id)):
            if value is not None and not 0 <= value < self._vocab_size:
                raise ValueError(f"{name}_token_id={value} is outside the vocabulary (size {self._vocab_size})")
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.unk_token_id = unk_token_id
        self.chat_template = chat_template
        special = backend.get_added_tokens_decoder()
        self.all_special_ids: list[int] = sorted(i for i, tok in special.items() if tok.special)
        stops = {eos_token_id} if eos_token_id is not None else set()
        stops.update(i for i in extra_stop_ids if 0 <= i < self._vocab_size)
        stops.update(i for t in END_OF_TURN_TOKENS if (i := backend.token_to_id(t)) in self.all_special_ids)
        self.stop_token_ids: frozenset[int] = frozenset(stops)
        self._token_bytes: dict[int, bytes] = {}

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        return cls.from_gguf_metadata(read_gguf_metadata(path, prefix="tokenizer."))

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """Build from GGUF metadata values (keys as in the file, e.g. 'tokenizer.ggml.tokens')."""
        backend, tokens = _gguf_backend(meta)

        def token_id(key: str) -> int | None:
            value = meta.get(key)
            is_id = isinstance(value, int) and not isinstance(value, bool) and 0 <= value < len(tokens)
            if value is not None and not is_id:
                raise ValueError(f"GGUF metadata {key}={value!r} is not a token id in [0, {len(tokens)})")
            return value

        bos = token_id("tokenizer.ggml.bos_token_id")
        eos = token_id("tokenizer.ggml.eos_token_id")
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
        if add_bos and bos is None:
            raise ValueError("tokenizer.ggml.add_bos_token is set but tokenizer.ggml.bos_token_id is missing")
        if add_eos and eos is None:
            raise ValueError("tokenizer.ggml.add_eos_token is set but tokenizer.ggml.eos_token_id is missing")
        if add_bos or add_eos:
            backend.post_processor = _bos_eos_processor(
                (tokens[bos], bos) if add_bos else None, (tokens[eos], eos) if add_eos else None
            )
        if eos is None:
            log.warning("GGUF has no tokenizer.ggml.eos_token_id: generation stops only on length or stop strings")
        end_of_turn = [token_id("tokenizer.ggml.eot_token_id"), token_id("tokenizer.ggml.eom_token_id")]
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_id=eos,
            pad_token_id=token_id("tokenizer.ggml.padding_token_id"),
            unk_token_id=token_id("tokenizer.ggml.unknown_token_id"),
            extra_stop_ids=[i for i in end_of_turn if i is not None],
            chat_template=meta.get("tokenizer.chat_template"),
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Load tokenizer.json (+ tokenizer_config.json, chat_template.jinja, generation_config.json)."""
        path = Path(path)
        tokenizer_json = path / "tokenizer.json"
        if not tokenizer_json.is_file():
            raise FileNotFoundError(f"{path}: no tokenizer.json (only fast-tokenizer checkpoints are supported)")
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_json))
        config = _read_json(path / "tokenizer_config.json")
        generation = _read_json(path / "generation_config.json")

        def id_of(key: str) -> int | None:
            value = config.get(key)
            content = value.get("content") if isinstance(value, dict) else value
            return backend.token_to_id(content) if isinstance(content, str) else None

        gen_eos = generation.get("eos_token_id")
        gen_eos = [i for i in (gen_eos if isinstance(gen_eos, list) else [gen_eos]) if isinstance(i, int)]
        eos = id_of("eos_token")
        if eos is None and gen_eos:
            eos = gen_eos[0]
        template_file = path / "chat_template.jinja"  # newer transformers save the template beside the config
        template = template_file.read_text() if template_file.is_file() else _pick_template(config.get("chat_template"))
        return cls(
            backend,
            bos_token_id=id_of("bos_token"),
            eos_token_id=eos,
            pad_token_id=id_of("pad_token"),
            unk_token_id=id_of("unk_token"),
            extra_stop_ids=gen_eos,
            chat_template=template,
        )

    @classmethod
    def from_model(cls, path: str | Path) -> Tokenizer:
        """The tokenizer of a model: a .gguf file's, or a Hugging Face directory's."""
        return cls.from_hf_dir(path) if Path(path).is_dir() else cls.from_gguf(path)

    def save(self, directory: str | Path) -> list[Path]:
        """Write tokenizer.json, tokenizer_config.json (special tokens, chat template) and
        generation_config.json (the stop ids), as a Hugging Face tokenizer directory that
        `transformers.AutoTokenizer` and `from_hf_dir` load with the same ids and template."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        self._backend.save(str(out / "tokenizer.json"))
        (out / "tokenizer_config.json").write_text(json.dumps(self.hf_config(), indent=2))
        (out / "generation_config.json").write_text(json.dumps({"eos_token_id": sorted(self.stop_token_ids)}, indent=2))
        return [out / f for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json")]

    def hf_config(self, model_max_length: int = 10**30) -> dict:
        """tokenizer_config.json's content: special tokens, chat template (also vLLM's /tokenizer_info)."""
        name = lambda i: None if i is None else self.id_to_token(i)  # noqa: E731
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
                  "bos_token": name(self.bos_token_id), "eos_token": name(self.eos_token_id),
                  "pad_token": name(self.pad_token_id), "unk_token": name(self.unk_token_id),
                  "model_max_length": model_max_length, "add_bos_token": False, "add_eos_token": False,
                  "chat_template": self.chat_template}
        return {k: v for k, v in config.items() if v is not None}

    # -- use --------------------------------------------------------------------------------------

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying `tokenizers.Tokenizer` (batch encoding, saving as tokenizer.json)."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_token_id is None else self.id_to_token(self.eos_token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` adds BOS/EOS only if the tokenizer asks for them.

        Special-token strings inside `text` ("<|im_start|>") always become their single ids, as in HF.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        ids = [operator.index(i) for i in ids]  # numpy/torch integers welcome; floats are a bug upstream
        if ids and not (0 <= min(ids) and max(ids) < self._vocab_size):
            bad = next(i for i in ids if not 0 <= i < self._vocab_size)
            raise ValueError(f"token id {bad} is outside the vocabulary (size {self._vocab_size})")
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for: a byte-level BPE piece mapped back to its bytes (which
        may be part of a character), an added token's own text."""
        cached = self._token_bytes.get(token_id)
        if cached is not None:
            return cached
        piece = self._backend.id_to_token(token_id) or ""
        added = self._backend.get_added_tokens_decoder().get(token_id)
        if added is None and all(c in _UNICODE_TO_BYTE for c in piece):
            out = bytes(_UNICODE_TO_BYTE[c] for c in piece)
        else:
            out = piece.encode()
        self._token_bytes[token_id] = out
        return out

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self._vocab_size}, bos={self.bos_token_id}, eos={self.eos_token_id})"


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_UNICODE_TO_BYTE = _byte_alphabet()


def _bos_eos_processor(bos: tuple[str, int] | None, eos: tuple[str, int] | None) -> processors.TemplateProcessing:
    """What `add_special_tokens=True` adds around a sequence: "<bos> $A <eos>" with either side optional."""
    before = f"{bos[0]} " if bos else ""
    after = f" {eos[0]}" if eos else ""
    specials = list(dict.fromkeys(t for t in (bos, eos) if t))
    return processors.TemplateProcessing(
        single=f"{before}$A{after}", pair=f"{before}$A{after} {before}$B:1{after}", special_tokens=specials
    )


def _need_list(meta: Mapping[str, Any], key: str, item_type: type) -> list:
    value = meta.get(key)
    if value is None:
        raise ValueError(f"GGUF metadata is missing {key}")
    if not isinstance(value, list) or not value or not all(isinstance(v, item_type) for v in value[:16]):
        raise ValueError(f"GGUF metadata {key} must be a non-empty list of {item_type.__name__}")
    return value


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: invalid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _pick_template(value: Any) -> str | None:
    """tokenizer_config's chat_template is a string, or a list of {name, template} (pick 'default')."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    raise ValueError(f"tokenizer_config.json chat_template has unexpected type {type(value).__name__}")
