"""Tiny random checkpoints of the supported HF architectures, saved by transformers itself.

Weights are drawn large enough (0.3) that greedy choices are far from ties; norms near 1.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

# GQA, head_dim 16; callers pick the vocabulary and the switches under test.
BASE = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            num_hidden_layers=2, max_position_embeddings=256, rope_theta=1e4, rms_norm_eps=1e-6,
            bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)  # fmt: skip
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)

_CLASSES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
}


def hf_config(kind: str, vocab_size: int, **overrides) -> PretrainedConfig:
    """The transformers config of a tiny `kind` (llama | qwen3 | qwen3_moe) model."""
    settings = {**BASE, **(MOE if kind == "qwen3_moe" else {}), "vocab_size": vocab_size, **overrides}
    return _CLASSES[kind][0](**settings)


def random_hf_model(kind: str, vocab_size: int, seed: int = 0, **overrides) -> torch.nn.Module:
    """A float32 transformers model of `kind` with random weights, in eval mode."""
    config = hf_config(kind, vocab_size, **overrides)
    torch.manual_seed(seed)
    hf = _CLASSES[kind][1](config)
    with torch.no_grad():  # HF's init leaves biases at 0 and norms at 1: randomise everything.
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    return hf.float().eval()


def save_random_hf_model(path: Path, kind: str, vocab_size: int, seed: int = 0, **overrides) -> str:
    random_hf_model(kind, vocab_size, seed, **overrides).save_pretrained(path)
    return str(path)


def save_word_tokenizer(path: Path, vocab_size: int) -> str:
    """A word-level tokenizer over made-up words ("w3" is id 3), saved as tokenizer.json in `path`.

    For engines that need a tokenizer beside weights whose vocabulary no real one fits.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)
    return str(path)
