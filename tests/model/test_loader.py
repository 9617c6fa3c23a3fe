"""Checkpoint loading: GGUF (with llama.cpp's Q/K permutation undone) and safetensors give the same
model; bad files fail with a clear error naming the problem."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from shared.model.hub import ModelNotFoundError, resolve_model_path
from shared.model.llama import load_model
from shared.model.loader import ModelLoadError, open_checkpoint
from tests.model_utils import tiny_model

gguf = pytest.importorskip("gguf")


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to Q and K rows (HF → interleaved rotary)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_state_dict(model) -> dict[str, torch.Tensor]:
    """The tiny model's weights under HF names, unfused."""
    cfg = model.config
    sd = {"model.embed_tokens.weight": model.embed_tokens.weight, "model.norm.weight": model.norm.weight}
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        wq, wk, wv = layer.self_attn.qkv_proj.weight.split([q, kv, kv])
        gate, up = layer.mlp.gate_up_proj.weight.chunk(2)
        sd |= {p + "self_attn.q_proj.weight": wq, p + "self_attn.k_proj.weight": wk, p + "self_attn.v_proj.weight": wv,
               p + "self_attn.o_proj.weight": layer.self_attn.o_proj.weight,
               p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
               p + "mlp.down_proj.weight": layer.mlp.down_proj.weight,
               p + "input_layernorm.weight": layer.input_layernorm.weight,
               p + "post_attention_layernorm.weight": layer.post_attention_layernorm.weight}
    return {k: v.detach().contiguous() for k, v in sd.items()}


def write_gguf(path, model, arch: str = "llama") -> None:
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_model_len)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_vocab_size(cfg.vocab_size)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for name, t in hf_state_dict(model).items():
        a = t.numpy().astype(np.float32)
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        else:
            _, _, i, *rest = name.split(".")
            gname = f"blk.{i}.{names['.'.join(rest[:-1])]}.weight"
            if gname.endswith("attn_q.weight"):
                a = llama_cpp_permute(a, cfg.num_heads)
            elif gname.endswith("attn_k.weight"):
                a = llama_cpp_permute(a, cfg.num_kv_heads)
        w.add_tensor(gname, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _logits(model, ids):
    from tests.model_utils import contiguous_forward

    return contiguous_forward(model, ids, None)[0]


def test_gguf_roundtrip_undoes_rotary_permutation(tmp_path):
    ref = tiny_model(seed=3)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, ref)
    loaded = load_model(path)
    assert loaded.config.tie_word_embeddings and loaded.config.num_kv_heads == 2
    got = hf_state_dict(loaded)
    for name, a in hf_state_dict(ref).items():
        torch.testing.assert_close(got[name], a, msg=name)
    ids = [5, 17, 3, 60, 2, 9]
    torch.testing.assert_close(_logits(loaded, ids), _logits(ref, ids))


def test_safetensors_directory_loads_same_model(tmp_path):
    from safetensors.torch import save_file

    ref = tiny_model(seed=4)
    cfg = ref.config
    save_file(hf_state_dict(ref), str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_model_len, "tie_word_embeddings": True}))
    loaded = load_model(tmp_path)
    ids = [1, 2, 3, 4, 50]
    torch.testing.assert_close(_logits(loaded, ids), _logits(ref, ids))


def test_bf16_load(tmp_path):
    ref = tiny_model(seed=5)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, ref)
    loaded = load_model(path, dtype=torch.bfloat16)
    assert loaded.embed_tokens.weight.dtype == torch.bfloat16
    assert loaded.rope.cos.dtype == torch.float32


def test_unknown_model_path_names_it(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelNotFoundError, match="nope.gguf.*does not exist"):
        resolve_model_path(missing)
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        open_checkpoint(missing)


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "garbage.gguf"
    bad.write_bytes(b"\x00" * 1000)
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        open_checkpoint(bad)


def test_truncated_gguf(tmp_path, default_gguf):
    cut = tmp_path / "truncated.gguf"
    with open(default_gguf, "rb") as f:
        cut.write_bytes(f.read(1 << 20))  # header and metadata, then nothing
    with pytest.raises(ModelLoadError, match="corrupt or truncated"):
        load_model(cut)


def test_corrupt_gguf_header(tmp_path, default_gguf):
    bad = tmp_path / "corrupt.gguf"
    with open(default_gguf, "rb") as f:
        data = bytearray(f.read(1 << 20))
    data[8:16] = b"\xff" * 8  # tensor count → absurd
    bad.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="corrupt or truncated"):
        load_model(bad)


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    write_gguf(path, tiny_model(), arch="gpt2")
    with pytest.raises(ModelLoadError, match="unsupported architecture 'gpt2'"):
        load_model(path)


def test_hf_dir_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        open_checkpoint(tmp_path)


def test_hf_dir_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        open_checkpoint(tmp_path)


def test_own_gguf_reader_matches_gguf_package(default_gguf):
    """Our mmap reader (fast metadata, tensor index) against the reference `gguf.GGUFReader`."""
    from gguf.quants import dequantize

    from shared.model.gguf_file import GGUFFile

    ours = GGUFFile(default_gguf)
    ref = gguf.GGUFReader(str(default_gguf))
    assert ours.metadata["llama.block_count"] == ref.fields["llama.block_count"].contents()
    assert ours.metadata["tokenizer.ggml.merges"] == ref.fields["tokenizer.ggml.merges"].contents()
    assert set(ours.tensors) == {t.name for t in ref.tensors}
    for t in ref.tensors[:12] + ref.tensors[-3:]:  # every tensor kind present: Q8_0, Q4_1, F32
        np.testing.assert_array_equal(ours.dequantize(t.name), dequantize(t.data, t.tensor_type), err_msg=t.name)
