"""The real model, end to end through the engine."""

from __future__ import annotations

import pytest

from shared.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.model.chat_template import render_chat
from shared.model.sampling_params import SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(default_gguf):
    """The default configuration: the file's weight blocks, the fused forward."""
    return LLMEngine.from_config(EngineConfig(model=str(default_gguf), num_kv_blocks=256))


@pytest.fixture(scope="module")
def exact_engine(default_gguf):
    """fp32 dense weights and an fp32 KV cache: the exact evaluation of the file."""
    return LLMEngine.from_config(EngineConfig(model=str(default_gguf), num_kv_blocks=256, quantization="none",
                                              kv_cache_dtype="float32"))


def chat_ids(engine, question: str) -> list[int]:
    tok = engine.tokenizer
    text = render_chat(tok.chat_template, [{"role": "user", "content": question}], add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("which", ["engine", "exact_engine"])
@pytest.mark.parametrize("question", ["What is the capital of France?", "Which city is the capital of France?"])
def test_capital_of_france(which, question, request):
    """The README's own question: the default configuration answers it like the exact one (the old
    bf16 + int8 default answered "L'Étoile…": fp32 ranks "The" over "L" by only 0.08 of a logit)."""
    engine = request.getfixturevalue(which)
    [out] = engine.generate([chat_ids(engine, question)], SamplingParams(temperature=0.0, max_tokens=32))
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # the model ends its turn with <|im_end|>
    assert out.text == engine.tokenizer.decode(out.new_token_ids, skip_special_tokens=True)
    engine.pool.check_invariants()
    assert engine.pool.num_used_blocks == 0


def test_seeded_sampling_is_reproducible_and_batch_independent(engine):
    prompt = chat_ids(engine, "Write a short poem about the sea.")
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=24)
    [alone] = engine.generate([prompt], params)
    other = SamplingParams(temperature=1.0, seed=99, max_tokens=24)
    batched = engine.generate([chat_ids(engine, "Count to ten."), prompt], [other, params])
    assert batched[1].new_token_ids == alone.new_token_ids
    [different_seed] = engine.generate([prompt], SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=4321,
                                                                 max_tokens=24))
    assert different_seed.new_token_ids != alone.new_token_ids


def test_stop_string_cuts_text_and_max_tokens_ends_with_length(engine):
    prompt = chat_ids(engine, "List the numbers from 1 to 20, separated by commas.")
    [free] = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=48))
    assert "5" in free.text
    cut_at = free.text.index("5")
    [stopped] = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=48, stop=["5"]))
    assert stopped.finish_reason == "stop" and stopped.stop_reason == "5"
    assert stopped.text == free.text[:cut_at]
    [short] = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=3))
    assert short.finish_reason == "length" and len(short.new_token_ids) == 3
    assert short.new_token_ids == free.new_token_ids[:3]
