"""Llama-family decoder (Llama, SmolLM2, Qwen2) over a flat token batch and a paged KV cache.

Parameter names follow HF (`model.layers.N.self_attn...`) except that q/k/v and gate/up are
fused into `qkv_proj` / `gate_up_proj` (one GEMM instead of three / two); `load_weights`
takes HF-named tensors and slices them into the fused parameters.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from fastdeploy.config import ModelConfig
from fastdeploy.model_executor.layers.attention import Attention
from fastdeploy.model_executor.layers.attention_metadata import AttentionMetadata
from fastdeploy.model_executor.layers.layernorm import RMSNorm
from fastdeploy.model_executor.layers.rotary import apply_rope, rope_cos_sin


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rope(q.view(-1, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(k.view(-1, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual add is fused into the norms: x is the previous sub-block's output.
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos, sin, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # RoPE angles once per step, shared by every layer.
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, x.dtype)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, cos, sin, kv_cache, meta)
        x, _ = self.norm(x, residual)
        return x


# HF checkpoint name fragment -> (fused parameter fragment, shard index).
_STACKED = {
    ".q_proj.": (".qkv_proj.", 0),
    ".k_proj.": (".qkv_proj.", 1),
    ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        # Tied models reuse the embedding matrix in compute_logits instead of sharing a
        # Parameter, so tying survives meta-device construction and `to_empty`.
        self.lm_head: nn.Linear | None = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # int64 [T]
        positions: torch.Tensor,  # int64 [T]
        attn_metadata: AttentionMetadata,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:  # [T, hidden], after the final norm
        return self.model(input_ids, positions, attn_metadata, kv_caches)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, vocab] for the selected hidden states [N, hidden]."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    def _shard_sizes(self, fused: str) -> list[int]:
        c = self.config
        if fused == ".qkv_proj.":
            q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
            return [q, kv, kv]
        return [c.intermediate_size, c.intermediate_size]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into this model's (fused) parameters; returns the names filled.

        Unknown names raise; `lm_head.weight` of a tied model and RoPE buffers are skipped.
        A fused parameter counts as loaded once all of its shards have arrived.
        """
        params = dict(self.named_parameters())
        shards_seen: dict[str, set[int]] = {}
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (self.lm_head is None and name == "lm_head.weight"):
                continue
            for frag, (fused, idx) in _STACKED.items():
                if frag in name:
                    target = name.replace(frag, fused)
                    sizes = self._shard_sizes(fused)
                    offset = sum(sizes[:idx])
                    param = params[target]
                    dst = param.narrow(0, offset, sizes[idx])
                    if dst.shape != tensor.shape:
                        raise ValueError(f"{name}: expected shape {tuple(dst.shape)}, got {tuple(tensor.shape)}")
                    dst.copy_(tensor)
                    shards_seen.setdefault(target, set()).add(idx)
                    if len(shards_seen[target]) == len(sizes):
                        loaded.add(target)
                    break
            else:
                if name not in params:
                    raise KeyError(f"unexpected weight {name!r}")
                param = params[name]
                if param.shape != tensor.shape:
                    raise ValueError(f"{name}: expected shape {tuple(param.shape)}, got {tuple(tensor.shape)}")
                param.copy_(tensor)
                loaded.add(name)
        return loaded
