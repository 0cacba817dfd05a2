"""Multi-token-prediction (MTP) draft module for a Llama-family target.

For position j it combines the target's hidden state at j-1 (after the final norm) with
the embedding of token j, each normalised, concatenated and projected back to the
hidden size; one decoder block (with its own paged K/V) follows, then the target's
final norm and shared head give logits for token j+1. Its own output can stand in for
the target's hidden state, so it applies recursively for several draft tokens.

`forward` runs on the paged KV cache like the target (serving); `forward_dense` runs
whole sequences with causal attention and no cache (training and tests).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, replace

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from fastdeploy.common.config import ModelConfig
from fastdeploy.model_executor.layers.attention_metadata import AttentionMetadata
from fastdeploy.model_executor.layers.layernorm import RMSNorm
from fastdeploy.model_executor.layers.rotary import rope_cos_sin
from fastdeploy.model_executor.models.llama import LlamaDecoderLayer

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


class MTPHead(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.enorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hnorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.layer = LlamaDecoderLayer(config)

    def _combine(self, token_embeds: torch.Tensor, prev_hidden: torch.Tensor) -> torch.Tensor:
        return self.eh_proj(torch.cat([self.enorm(token_embeds), self.hnorm(prev_hidden)], dim=-1))

    def forward(
        self,
        token_embeds: torch.Tensor,  # [T, H]: embeddings of tokens j
        prev_hidden: torch.Tensor,  # [T, H]: target (or MTP) hidden at j-1, after the final norm
        positions: torch.Tensor,  # int64 [T]: j
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,  # this module's own paged K/V
        final_norm: RMSNorm,  # the target's
    ) -> torch.Tensor:  # [T, H], after the target's final norm; feed it to the target's head
        x = self._combine(token_embeds, prev_hidden)
        c = self.config
        cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta, x.dtype, c.rope_scaling)
        out, residual = self.layer(x, None, cos, sin, kv_cache, meta)
        assert isinstance(out, torch.Tensor), "summed: the layer runs without pending sums"
        return final_norm(out, residual)[0]

    def forward_dense(
        self,
        token_embeds: torch.Tensor,  # [B, L, H]
        prev_hidden: torch.Tensor,  # [B, L, H]
        final_norm: RMSNorm,
    ) -> torch.Tensor:  # [B, L, H]
        """The same computation over whole sequences starting at position 0, with causal attention."""
        c = self.config
        batch, length, _ = token_embeds.shape
        x = self._combine(token_embeds, prev_hidden)
        positions = torch.arange(length, device=x.device).repeat(batch)
        cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta, x.dtype, c.rope_scaling)
        layer = self.layer
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q, k, v = attn.qkv(h.flatten(0, 1), cos, sin, fused=False)
        q = q.view(batch, length, attn.num_heads, c.head_dim).transpose(1, 2)
        k = k.view(batch, length, attn.num_kv_heads, c.head_dim).transpose(1, 2)
        v = v.view(batch, length, attn.num_kv_heads, c.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=c.head_dim**-0.5,
                                             enable_gqa=attn.num_kv_heads != attn.num_heads)
        attn_out = attn.out(out.transpose(1, 2).reshape(batch, length, attn.q_size))
        assert isinstance(attn_out, torch.Tensor), "summed: called without `pending`"
        out, residual = layer.post_attention_layernorm(attn_out, x)
        # Flat [tokens, hidden] rows: the layout the MLP's fused CUDA kernel takes.
        out = layer.mlp(out.flatten(0, 1)).view(batch, length, -1)
        return final_norm(out, residual)[0]


def mtp_config(target: ModelConfig, intermediate_size: int | None = None) -> ModelConfig:
    """The draft block's shape: the target's, optionally with a narrower MLP; always a dense MLP."""
    return replace(target, num_hidden_layers=1, intermediate_size=intermediate_size or target.intermediate_size,
                   moe=None)


def save_mtp_head(head: MTPHead, directory: str, dtype: torch.dtype = torch.bfloat16, **extra: object) -> None:
    os.makedirs(directory, exist_ok=True)
    state = {name: t.detach().to("cpu", dtype).contiguous() for name, t in head.state_dict().items()}
    save_file(state, os.path.join(directory, WEIGHTS_FILE))
    with open(os.path.join(directory, CONFIG_FILE), "w") as f:
        json.dump({"model_type": "fastdeploy_mtp", **asdict(head.config), **extra}, f, indent=2)


SHIPPED_HEADS = os.path.join(os.path.dirname(__file__), "mtp_heads")
EMBEDDED_HEAD = "smollm2-135m-instruct"


def shipped_mtp_head(model: str | None) -> str:
    """The head shipped for the embedded model (`model` None); other models need `"model": DIR`."""
    if model is not None:
        raise ValueError('MTP speculation on this model needs "model": a directory with an MTP head '
                         f"({CONFIG_FILE} + {WEIGHTS_FILE}, see tools/train_mtp.py)")
    return os.path.join(SHIPPED_HEADS, EMBEDDED_HEAD)


def load_mtp_head(directory: str, target: ModelConfig, dtype: torch.dtype, device: str | torch.device) -> MTPHead:
    """Load a head saved by `save_mtp_head`; its shape must fit the target."""
    with open(os.path.join(directory, CONFIG_FILE)) as f:
        saved = json.load(f)
    for key in ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
        if saved.get(key) != getattr(target, key):
            raise ValueError(f"MTP head in {directory} has {key}={saved.get(key)}, the target has "
                             f"{getattr(target, key)}")
    head = MTPHead(mtp_config(target, saved["intermediate_size"]))
    head.load_state_dict(load_file(os.path.join(directory, WEIGHTS_FILE)))
    return head.to(device=device, dtype=dtype).eval()
