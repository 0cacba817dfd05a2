"""Qwen3, Qwen3-MoE and Llama with RoPE scaling from HF directories vs HF transformers, greedy, float32.

Each checkpoint is a tiny random model saved by transformers itself; ours loads it through the
safetensors loader and decodes through the paged KV cache (prefill in two chunks, batched
decode steps), HF through its own generate-style loop. Prompts and generations run past
`original_max_position_embeddings`, where the scaled frequencies differ from plain RoPE.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from fastdeploy.model_executor.model_loader import get_model
from fastdeploy.model_executor.model_loader.hf_config import UnsupportedConfigError, model_config_from_hf_dict
from fastdeploy.model_executor.models.llama import LlamaForCausalLM
from tests.models.test_llama_vs_hf import PagedRunner, _hf_greedy, _run, _two_chunks
from tests.random_hf_models import hf_config, random_hf_model

VOCAB = 256
NEW_TOKENS = 16
PROMPT_LENS = (40, 23, 57)  # with 16 new tokens, positions up to 72: past the original 32 below

LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}  # fmt: skip
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
CASES = {
    "qwen3": ("qwen3", {}),
    "qwen3-bias-tied": ("qwen3", {"attention_bias": True, "tie_word_embeddings": True}),
    "qwen3-yarn": ("qwen3", {"rope_parameters": {**YARN, "rope_theta": 1e4}}),
    # Layers 0 and 2 sparse, 1 dense (mlp_only_layers); renormalised top-k weights.
    "qwen3_moe-norm": ("qwen3_moe", {"num_hidden_layers": 3, "mlp_only_layers": [1], "norm_topk_prob": True}),
    # decoder_sparse_step 2: layers 1 and 3 sparse; raw top-k probabilities; 4 of 8 experts per token.
    "qwen3_moe-step2": ("qwen3_moe", {"num_hidden_layers": 4, "decoder_sparse_step": 2, "norm_topk_prob": False,
                                      "num_experts_per_tok": 4}),
    "llama-linear": ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 3.0, "rope_theta": 1e4}}),
    "llama-llama3": ("llama", {"rope_parameters": {**LLAMA3, "rope_theta": 1e4}}),
    "llama-yarn": ("llama", {"rope_parameters": {**YARN, "rope_theta": 1e4, "beta_fast": 16.0, "mscale": 0.8,
                                                 "mscale_all_dim": 0.5}}),
}  # fmt: skip


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def _ours(model: LlamaForCausalLM, prompts: list[list[int]]) -> dict[int, tuple[list[int], list[float]]]:
    return _run(PagedRunner(model, model.config), dict(enumerate(prompts)),
                {i: (0, _two_chunks(p)) for i, p in enumerate(prompts)}, NEW_TOKENS)  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_matches_hf(tmp_path, case: str) -> None:
    kind, overrides = CASES[case]
    hf = random_hf_model(kind, VOCAB, **overrides)
    hf.save_pretrained(tmp_path)
    model, config = get_model(str(tmp_path))
    assert config.architecture == kind and config.qk_norm == (kind != "llama")
    assert (config.moe is not None) == (kind == "qwen3_moe")
    prompts = _prompts()
    ours = _ours(model, prompts)
    ref_tokens, ref_logprobs, gaps = _hf_greedy(hf, prompts, NEW_TOKENS)
    worst = 0.0
    for i in range(len(prompts)):
        tokens, logprobs = ours[i]
        assert tokens == ref_tokens[i], f"prompt {i}: ours {tokens} vs HF {ref_tokens[i]}; min top-2 gap {gaps[i]:.2e}"
        worst = max(worst, (torch.tensor(logprobs) - torch.tensor(ref_logprobs[i])).abs().max().item())
    print(f"{case}: max |logprob - HF| = {worst:.2e}")
    assert worst < 1e-4

    if config.rope_scaling is not None:
        # The scaling matters at these positions: plain RoPE would not match HF.
        model.config = model.model.config = replace(config, rope_scaling=None)
        plain = _ours(model, prompts)
        diff = max((torch.tensor(plain[i][1]) - torch.tensor(ref_logprobs[i])).abs().max().item()
                   for i in range(len(prompts)))  # fmt: skip
        assert diff > 1e-2 or any(plain[i][0] != ref_tokens[i] for i in range(len(prompts)))


def _config(kind: str, **overrides) -> dict:
    """The config.json transformers writes for a tiny `kind` model, with `overrides` on top."""
    return {**json.loads(hf_config(kind, VOCAB).to_json_string()), **overrides}


REFUSED = [
    ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "rope_type"),
    ("llama", {"rope_scaling": {"type": "longrope", "factor": 2.0}}, "longrope"),
    ("llama", {"mlp_bias": True}, "mlp_bias"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act"),
    ("llama", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ("llama", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4, "short_factor": [1.0]}},
     "rope_scaling.short_factor"),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 64}, "use_sliding_window"),
    ("qwen3", {"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    ("qwen3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ("qwen3_moe", {"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size"),
    ("qwen3_moe", {"quantization_config": {"quant_method": "awq", "bits": 4}}, "quantization_config"),
]  # fmt: skip


@pytest.mark.parametrize("kind,overrides,key", REFUSED, ids=[r[2] for r in REFUSED])
def test_unimplemented_config_refused(kind: str, overrides: dict, key: str) -> None:
    with pytest.raises(UnsupportedConfigError, match=key):
        model_config_from_hf_dict(_config(kind, **overrides))


def test_refused_at_load(tmp_path) -> None:
    """The error reaches whoever loads the directory, before any weight is read."""
    random_hf_model("qwen3", VOCAB).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "use_sliding_window": True}))
    with pytest.raises(UnsupportedConfigError, match="use_sliding_window"):
        get_model(str(tmp_path))


def test_config_fields() -> None:
    """What the HF keys become: MoE layout, rope scaling details, biases, both spellings of the expert count."""
    moe = model_config_from_hf_dict(_config("qwen3_moe", num_hidden_layers=4, decoder_sparse_step=2,
                                            mlp_only_layers=[3], norm_topk_prob=True))  # fmt: skip
    assert [moe.moe.is_sparse(i) for i in range(4)] == [False, True, False, False]
    assert (moe.moe.num_experts, moe.moe.num_experts_per_tok, moe.moe.moe_intermediate_size) == (8, 2, 32)
    legacy = {k: v for k, v in _config("qwen3_moe").items() if k != "num_local_experts"}
    assert model_config_from_hf_dict({**legacy, "num_experts": 16}).moe.num_experts == 16
    llama = model_config_from_hf_dict(_config("llama", rope_parameters=None, rope_theta=5e5, rope_scaling={
        "type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64, "attention_factor": 0.9}))
    assert llama.rope_theta == 5e5 and llama.rope_scaling.rope_type == "yarn"
    assert llama.rope_scaling.attention_factor == 0.9 and llama.rope_scaling.original_max_position_embeddings == 64
    biased = model_config_from_hf_dict(_config("llama", attention_bias=True))
    assert biased.attention_bias and biased.o_proj_bias and not biased.qk_norm


def test_bundled_configs_load() -> None:
    """Every bundled dummy config passes the key check, with the fields of its real model."""
    from fastdeploy.model_executor.model_loader import resolve_model_path
    from fastdeploy.model_executor.model_loader.dummy_loader import dummy_model_config

    moe = dummy_model_config(resolve_model_path("qwen3_30b_a3b"))
    assert (moe.architecture, moe.num_hidden_layers, moe.hidden_size, moe.head_dim, moe.qk_norm) == (
        "qwen3_moe", 48, 2048, 128, True)  # fmt: skip
    assert (moe.moe.num_experts, moe.moe.num_experts_per_tok, moe.moe.moe_intermediate_size) == (128, 8, 768)
    assert all(moe.moe.is_sparse(i) for i in range(48)) and moe.moe.norm_topk_prob
    llama31 = dummy_model_config(resolve_model_path("llama3_1_8b"))
    assert llama31.rope_scaling.rope_type == "llama3" and llama31.rope_scaling.original_max_position_embeddings == 8192
    assert llama31.eos_token_ids == [128001, 128008, 128009]
    dense = dummy_model_config(resolve_model_path("qwen3_8b"))
    assert dense.qk_norm and dense.moe is None and dense.rope_scaling is None
