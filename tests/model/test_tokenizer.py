"""Tokenizer, chat template and incremental detokenizer, checked against the real SmolLM2 GGUF."""

from __future__ import annotations

import random
import re
import time

import pytest

from shared.model.chat_template import CHATML_TEMPLATE, ChatTemplateError, render_chat
from shared.model.detokenizer import IncrementalDetokenizer
from shared.model.gguf_file import read_gguf_metadata
from shared.model.tokenizer import Tokenizer

SAMPLES = [
    "Hello world",
    "The capital of France is Paris.",
    "  leading spaces, trailing spaces   ",
    "def add(a, b):\n\treturn a + b  # tab-indented\n\n\nclass X:\n    pass\n",
    "{\"key\": [1, 2, 3], 'x': None}\r\n",
    "12345 and 3.14159 and 1,000,000 in 2024",
    "中文 日本語のテキスト 한국어",
    "Emoji: 😀👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 heart ❤️",
    "Mixed: café naïve Ångström — “quotes” … ∑x² ≤ ∞ 中文🙂 done",
    "I'm sure they'll say it's fine, don't you think?",
]


@pytest.fixture(scope="module")
def metadata(default_gguf):
    return read_gguf_metadata(default_gguf, prefix="tokenizer.")


@pytest.fixture(scope="module")
def tok(default_gguf) -> Tokenizer:
    return Tokenizer.from_gguf(default_gguf)


def gguf_id(metadata, token: str) -> int:
    return metadata["tokenizer.ggml.tokens"].index(token)


# -- GGUF metadata and construction ----------------------------------------------------------------


def test_metadata_reader_matches_gguf_package(default_gguf, metadata):
    gguf = pytest.importorskip("gguf")
    reader = gguf.GGUFReader(default_gguf)
    expected = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    assert metadata.keys() == expected.keys()
    for key, value in expected.items():
        assert metadata[key] == value, key


def test_metadata_reader_rejects_broken_files(tmp_path, default_gguf):
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(default_gguf.read_bytes()[:200_000])  # cut inside the vocabulary array
    with pytest.raises(ValueError, match="corrupt or truncated"):
        read_gguf_metadata(truncated)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf_metadata(empty)


def test_builds_fast(default_gguf):
    start = time.perf_counter()
    Tokenizer.from_gguf(default_gguf)
    assert time.perf_counter() - start < 2.0


def test_special_ids_come_from_metadata(tok, metadata):
    assert tok.vocab_size == len(metadata["tokenizer.ggml.tokens"]) == 49152
    assert tok.eos_token_id == 2 == gguf_id(metadata, "<|im_end|>")
    assert tok.bos_token_id == metadata["tokenizer.ggml.bos_token_id"]
    assert tok.eos_token == "<|im_end|>"
    assert tok.pad_token_id == 2 and tok.unk_token_id == 0
    control = [i for i, t in enumerate(metadata["tokenizer.ggml.token_type"]) if t == 3]
    assert tok.all_special_ids == control
    assert tok.stop_token_ids == {gguf_id(metadata, "<|im_end|>"), gguf_id(metadata, "<|endoftext|>")}
    assert tok.chat_template == metadata["tokenizer.chat_template"]
    assert tok.token_to_id("ĠParis") == gguf_id(metadata, "ĠParis")
    assert tok.id_to_token(gguf_id(metadata, "ĠParis")) == "ĠParis"
    assert tok.token_to_id("not-a-token-xyz") is None


@pytest.mark.parametrize("special", ["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
def test_special_tokens_in_text_are_single_ids(tok, metadata, special):
    ids = tok.encode(f"a{special}b")
    assert ids == [tok.token_to_id("a"), gguf_id(metadata, special), tok.token_to_id("b")]
    assert tok.decode(ids) == f"a{special}b"
    assert tok.decode(ids, skip_special_tokens=True) == "ab"


def test_no_bos_added_because_metadata_says_so(tok):
    assert tok.encode("Hello world") == tok.encode("Hello world", add_special_tokens=False)


# -- encoding facts about the real vocabulary ----------------------------------------------------


def test_known_encodings(tok):
    assert tok.encode("Hello world") == [tok.token_to_id("Hello"), tok.token_to_id("Ġworld")]
    assert tok.encode(" Paris") == [tok.token_to_id("ĠParis")]
    # Digits are split one by one before BPE (llama.cpp 'smollm' = "\p{N}" then GPT-2's regex).
    assert tok.encode("12345") == [tok.token_to_id(d) for d in "12345"]
    assert tok.encode(" 2024") == [tok.token_to_id(t) for t in ("Ġ", "2", "0", "2", "4")]


def test_vocabulary_agrees_with_the_pre_tokenizer(tok):
    """A BPE never learns a token across a pre-tokenizer boundary, so the vocab shows the split used:
    no token joins a digit to anything (Digits(individual)), and whitespace only leads a token or
    is the whole token (GPT-2's ` ?\\p{L}+ | \\s+(?!\\S)` pieces)."""
    for i in range(tok.vocab_size):
        if i in tok.all_special_ids:
            continue
        text = tok.decode([i])
        if "\ufffd" in text:  # part of a multi-byte character
            continue
        assert not (len(text) > 1 and any(c.isdigit() for c in text)), (i, text)
        assert not re.search(r"\S\s", text), (i, text)


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_decode_rejects_bad_ids(tok):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([5, tok.vocab_size])
    with pytest.raises(TypeError):
        tok.encode(b"bytes")  # type: ignore[arg-type]


# -- chat template -------------------------------------------------------------------------------


def test_chat_template_adds_default_system_prompt(tok):
    prompt = render_chat(tok.chat_template, [{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.encode(prompt)
    assert ids[0] == tok.token_to_id("<|im_start|>") and ids.count(tok.token_to_id("<|im_end|>")) == 2


def test_chat_template_keeps_given_system_prompt(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt = render_chat(tok.chat_template, messages, add_generation_prompt=False)
    assert prompt == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"


def test_fallback_chatml_and_hf_helpers():
    chatml = render_chat(None, [{"role": "user", "content": "x"}])
    assert chatml == "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"
    template = "{% generation %}{{ messages | tojson }}{% endgeneration %}{{ strftime_now('%Y')|length }}"
    assert render_chat(template, [{"role": "user", "content": "<a&b>"}]) == '[{"role": "user", "content": "<a&b>"}]4'
    assert CHATML_TEMPLATE  # exported for callers that want to show what was used


@pytest.mark.parametrize(
    "messages, match",
    [
        ([], "empty"),
        ("hello", "list"),
        ([{"role": "robot", "content": "x"}], "role 'robot'"),
        ([{"role": "user"}], "content must be a string"),
        ([{"role": "user", "content": 3}], "content must be a string"),
        (["hi"], r"messages\[0\] must be a dict"),
    ],
)
def test_bad_messages(messages, match):
    with pytest.raises(ValueError, match=match):
        render_chat(CHATML_TEMPLATE, messages)


def test_template_errors_are_wrapped():
    user = [{"role": "user", "content": "x"}]
    with pytest.raises(ChatTemplateError, match="does not compile"):
        render_chat("{% if %}", user)
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        render_chat("{{ raise_exception('roles must alternate') }}", user)
    with pytest.raises(ChatTemplateError, match="'append' of 'list' object is unsafe"):
        render_chat("{{ messages.append(1) }}", user)  # the immutable sandbox refuses mutation
    with pytest.raises(ChatTemplateError, match="TypeError"):
        render_chat("{{ 'a' + 1 }}", user)


# -- incremental detokenization -------------------------------------------------------------------


class CountingTokenizer:
    """Wraps a tokenizer and records the longest id list decode() was given."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner, self.vocab_size, self.longest = inner, inner.vocab_size, 0

    def decode(self, ids, skip_special_tokens=False):
        self.longest = max(self.longest, len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.push(i) for i in ids] + [detok.flush()]


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("text", SAMPLES + ["<|im_start|>assistant\nSure!<|im_end|>"])
def test_incremental_equals_full_decode(tok, text, skip):
    ids = tok.encode(text)
    prompt = tok.encode(render_chat(tok.chat_template, [{"role": "user", "content": "Go"}]))
    for prompt_ids in (None, prompt):
        counting = CountingTokenizer(tok)
        detok = IncrementalDetokenizer(counting, prompt_ids=prompt_ids, skip_special_tokens=skip)
        deltas = stream(detok, ids)
        assert "".join(deltas) == detok.text == tok.decode(ids, skip_special_tokens=skip)
        assert not any("\ufffd" in d for d in deltas)  # never half a character
        assert counting.longest <= 12  # a sliding window, not the whole sequence


def test_multibyte_characters_are_held_until_complete(tok):
    char = "🦀"  # one code point, four UTF-8 bytes, several byte-level tokens
    ids = tok.encode(char)
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tok)
    assert [detok.push(i) for i in ids] == [""] * (len(ids) - 1) + [char]
    assert detok.flush() == ""
    # Cut off mid-character, the end of stream shows what decode() shows: a replacement character.
    cut = IncrementalDetokenizer(tok)
    assert "".join(stream(cut, ids[:-1])) == tok.decode(ids[:-1]) == "\ufffd"


def test_random_ids_still_match_full_decode(tok):
    """Model output need not be valid UTF-8: invalid bytes must come out exactly as decode() shows them."""
    rng = random.Random(0)
    for _ in range(5):
        ids = [rng.randrange(tok.vocab_size) for _ in range(300)]
        for skip in (True, False):
            detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
            assert "".join(stream(detok, ids)) == tok.decode(ids, skip_special_tokens=skip)


def test_skip_special_tokens_in_stream(tok):
    ids = tok.encode("Hi<|im_end|>")
    assert "".join(stream(IncrementalDetokenizer(tok), ids)) == "Hi"
    assert "".join(stream(IncrementalDetokenizer(tok, skip_special_tokens=False), ids)) == "Hi<|im_end|>"


def test_push_rejects_bad_ids(tok):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        IncrementalDetokenizer(tok).push(-1)


# -- construction from plain metadata (no file) ------------------------------------------------


def fake_metadata(**overrides):
    tokens = ["<|endoftext|>", "<tool>", "a", "b", "c", "ab", "abc", "Ġ", "Ġab"]
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3, 4] + [1] * (len(tokens) - 2),
        "tokenizer.ggml.merges": ["a b", "ab c", "Ġ ab"],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 0,
    }
    meta.update(overrides)
    return {k: v for k, v in meta.items() if v is not None}


def test_fake_metadata_builds_a_working_tokenizer():
    tok = Tokenizer.from_gguf_metadata(fake_metadata())
    assert tok.encode("abc ab<tool>") == [6, 8, 1]
    assert tok.decode([6, 8, 1, 0], skip_special_tokens=True) == "abc ab<tool>"  # user-defined is text
    assert tok.all_special_ids == [0] and tok.stop_token_ids == {0}


@pytest.mark.parametrize("pre", ["smollm", "starcoder", "gpt-2", "llama-bpe"])
def test_supported_pre_tokenizers_build(pre):
    tok = Tokenizer.from_gguf_metadata(fake_metadata(**{"tokenizer.ggml.pre": pre}))
    assert tok.decode(tok.encode("abc ab")) == "abc ab"


def test_add_bos_token_is_honoured():
    tok = Tokenizer.from_gguf_metadata(fake_metadata(**{"tokenizer.ggml.add_bos_token": True}))
    assert tok.encode("ab") == [0, 5]
    assert tok.encode("ab", add_special_tokens=False) == [5]


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"tokenizer.ggml.model": "llama"}, "'llama' \\(SentencePiece\\) is not supported"),
        ({"tokenizer.ggml.model": None}, "no tokenizer.ggml.model"),
        ({"tokenizer.ggml.tokens": None}, "missing tokenizer.ggml.tokens"),
        ({"tokenizer.ggml.merges": None}, "missing tokenizer.ggml.merges"),
        ({"tokenizer.ggml.pre": "mystery"}, "tokenizer.ggml.pre='mystery' is not supported"),
        ({"tokenizer.ggml.pre": None}, "no tokenizer.ggml.pre"),
        ({"tokenizer.ggml.merges": ["ab"]}, "not two pieces"),
        ({"tokenizer.ggml.merges": ["a zz"]}, "do not form a BPE model"),
        ({"tokenizer.ggml.token_type": [1]}, "1 entries for 9 tokens"),
        ({"tokenizer.ggml.eos_token_id": 99}, "eos_token_id=99 is not a token id"),
        ({"tokenizer.ggml.bos_token_id": None, "tokenizer.ggml.add_bos_token": True}, "bos_token_id is missing"),
    ],
)
def test_bad_metadata_raises_clear_errors(overrides, match):
    with pytest.raises(ValueError, match=match):
        Tokenizer.from_gguf_metadata(fake_metadata(**overrides))


def test_from_hf_dir(tmp_path, tok):
    (tmp_path / "tokenizer.json").write_text(tok.backend.to_str())
    (tmp_path / "tokenizer_config.json").write_text(
        '{"eos_token": "<|im_end|>", "bos_token": {"content": "<|im_start|>"}, "chat_template": "T"}'
    )
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [2, 0]}')
    hf = Tokenizer.from_hf_dir(tmp_path)
    assert (hf.bos_token_id, hf.eos_token_id, hf.chat_template) == (1, 2, "T")
    assert hf.stop_token_ids == {0, 2}
    assert hf.encode(SAMPLES[7]) == tok.encode(SAMPLES[7])
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path / "missing")


def test_exported_tokenizer_directory_loads_back_the_same(tok, tmp_path, default_gguf):
    """`pdserve model export-tokenizer`: the directory gives the same ids, special tokens, stop ids
    and chat template."""
    from services.cli import main

    assert main(["model", "export-tokenizer", str(tmp_path), "--model", str(default_gguf)]) == 0
    back = Tokenizer.from_hf_dir(tmp_path)
    texts = ["Hello world", "def f(x):\n    return x * 2", "日本語のテキスト", "<|im_start|>user\nhi<|im_end|>", "  12345 "]
    for text in texts:
        assert back.encode(text) == tok.encode(text)
        assert back.decode(tok.encode(text)) == tok.decode(tok.encode(text))
    assert (back.bos_token_id, back.eos_token_id, back.stop_token_ids) == (tok.bos_token_id, tok.eos_token_id,
                                                                          tok.stop_token_ids)
    assert back.chat_template == tok.chat_template
    assert back.all_special_ids == tok.all_special_ids


def test_token_bytes_join_to_the_text(tok):
    for text in ("Hello wörld", "日本 🎉 emoji", "tabs\tand\nnewlines"):
        ids = tok.encode(text, add_special_tokens=False)
        assert b"".join(tok.token_bytes(i) for i in ids).decode() == text
    assert tok.token_bytes(tok.eos_token_id) == tok.eos_token.encode()
