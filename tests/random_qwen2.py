"""A small Qwen2 with random weights, saved as a Hugging Face directory for engine tests."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen2Config
from transformers import Qwen2ForCausalLM as HFQwen2

# GQA, q/k/v biases, untied head; callers pick the vocabulary.
SMALL = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
             num_hidden_layers=2, max_position_embeddings=256, rope_theta=1e4, rms_norm_eps=1e-6,
             bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)  # fmt: skip


def save_random_qwen2(path: Path, vocab_size: int, seed: int = 0, write_scale: float = 0.3) -> str:
    """Weights drawn large enough (0.3) that logits are far from flat; norms near 1.
    `write_scale`: the scale of the projections that write into the residual stream (attention
    output, MLP down): small, and each token's logits are mostly a function of the token itself,
    with the context (and so every K/V the step reads) still moving them a little."""
    torch.manual_seed(seed)
    hf = HFQwen2(Qwen2Config(**SMALL, vocab_size=vocab_size))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            scale = write_scale if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.3
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else scale * torch.randn_like(p))
    hf.save_pretrained(path)
    return str(path)
