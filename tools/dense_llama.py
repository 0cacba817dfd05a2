"""Dense causal forward of the project's `LlamaForCausalLM`: no KV cache, whole padded sequences.

Training the MTP head needs the frozen target's hidden state (after the final norm) at every
position of many sequences; one batched call here replaces a paged prefill per sequence.
It uses the model's own modules in the same order as `LlamaModel.forward`, with causal
scaled-dot-product attention in place of the paged kernel (right padding never reaches an
earlier position, so rows past a sequence's end are the only ones that are meaningless).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastdeploy.model_executor.layers.rotary import rope_cos_sin
from fastdeploy.model_executor.models.llama import LlamaAttention, LlamaForCausalLM


def _attention(attn: LlamaAttention, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               batch: int, length: int) -> torch.Tensor:
    d = attn.head_dim
    q, k, v = attn.qkv(h, cos, sin)
    q = q.view(batch, length, attn.num_heads, d).transpose(1, 2)
    k = k.view(batch, length, attn.num_kv_heads, d).transpose(1, 2)
    v = v.view(batch, length, attn.num_kv_heads, d).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=d**-0.5,
                                         enable_gqa=attn.num_kv_heads != attn.num_heads)
    return attn.out(out.transpose(1, 2).reshape(batch * length, attn.q_size))


@torch.no_grad()
def dense_hidden_states(model: LlamaForCausalLM, input_ids: torch.Tensor) -> torch.Tensor:
    """Hidden states [B, L, H] after the final norm for token ids [B, L] at positions 0..L-1."""
    c = model.config
    batch, length = input_ids.shape
    # The modules get flat [tokens, hidden] rows, the layout the engine gives them.
    x = model.model.embed_tokens(input_ids.reshape(-1))
    positions = torch.arange(length, device=input_ids.device).repeat(batch)
    cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta, x.dtype, c.rope_scaling)
    residual = None
    for layer in model.model.layers:
        if residual is None:
            residual = x
            x = layer.input_layernorm(x)
        else:
            x, residual = layer.input_layernorm(x, residual)
        x = _attention(layer.self_attn, x, cos, sin, batch, length)
        x, residual = layer.post_attention_layernorm(x, residual)
        x = layer.mlp(x)
    return model.model.norm(x, residual)[0].view(batch, length, -1)
