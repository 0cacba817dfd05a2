"""Llama-family decoder (Llama, SmolLM2, Qwen2, Qwen3, Qwen3-MoE) over a flat token batch and a paged KV cache.

The architectures differ only in switches of ModelConfig: q/k/v (and o_proj) biases, Qwen3's
RMSNorm of each query/key head before RoPE, RoPE scaling, and Qwen3-MoE's sparse MLP layers
(`layers/moe.py`) in place of the dense one.

Parameter names follow HF (`model.layers.N.self_attn...`) except that q/k/v and gate/up are
fused into `qkv_proj` / `gate_up_proj` (one GEMM instead of three / two), and a sparse layer's
experts are stacked into `mlp.experts.w13_weight` / `w2_weight`; `load_weights` takes
HF-named tensors and slices them into the fused parameters.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from fastdeploy.common.config import ModelConfig
from fastdeploy.distributed.parallel_state import (
    PendingSum,
    all_gather_last_dim,
    all_reduce,
    row_parallel_linear,
    sum_add_rms_norm,
    tp_rank,
    tp_size,
    vocab_parallel_logits,
)
from fastdeploy.distributed.shard import local_config, shard_weight, vocab_shard
from fastdeploy.model_executor.layers.attention import Attention
from fastdeploy.model_executor.layers.attention_metadata import AttentionMetadata, CacheWrite
from fastdeploy.model_executor.layers.cpu_kernels import cpu_ops, fused_cpu
from fastdeploy.model_executor.layers.layernorm import RMSNorm
from fastdeploy.model_executor.layers.moe import MoEExperts, SparseMoeBlock, expert_weight_slot
from fastdeploy.model_executor.layers.quantized_linear import GGUFLinear
from fastdeploy.model_executor.layers.rotary import apply_rope, rope_cos_sin


def _fused():
    """The Triton kernels used on CUDA; imported on first use since triton is optional on CPU hosts."""
    from fastdeploy.model_executor.layers import triton_fused

    return triton_fused


def _norm(norm: RMSNorm, x: torch.Tensor | PendingSum, residual: torch.Tensor | None = None):
    """`norm(x, residual)`, as one fused kernel on CUDA and, in float32 inference, on the CPU; for
    a `PendingSum` x, in the kernel that also sums it over the tensor-parallel ranks."""
    if isinstance(x, PendingSum):
        assert residual is not None, "a sub-block's output is added to the residual stream"
        return sum_add_rms_norm(x, residual, norm.weight, norm.eps)
    if x.is_cuda:
        return _fused().add_rms_norm(x, residual, norm.weight, norm.eps)
    if fused_cpu(x) and x.is_contiguous() and (residual is None or residual.is_contiguous()):
        if residual is None:  # x is the caller's residual stream: normalise a copy
            out = x.clone()
            cpu_ops().add_rms_norm_(out, None, norm.weight, norm.eps)
            return out
        # In place: x is the previous sub-block's fresh output, dead after the sum.
        cpu_ops().add_rms_norm_(x, residual, norm.weight, norm.eps)
        return x, residual
    return norm(x, residual)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # Tensor parallelism: this rank's heads (q/k/v are column-parallel, o_proj row-parallel).
        self.num_heads = config.num_attention_heads // tp_size()
        self.num_kv_heads = config.num_key_value_heads // tp_size()
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)
        # Qwen3: one RMSNorm over head_dim, shared by all query heads (and one by all key heads).
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)

    def qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused: bool | None = None,
        cache: CacheWrite | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """q [T, heads, head_dim], k and v [T, kv_heads, head_dim] of rows `x` [T, hidden], q/k normed and rotated.

        `fused` (default: on CUDA) norms and rotates in place with a Triton kernel, which with
        `cache` also writes K and V into the paged cache; False keeps the PyTorch ops, which
        autograd can follow (MTP head training), and writes nothing.
        """
        qkv = self.qkv_proj(x)
        fused = qkv.is_cuda if fused is None else fused
        if fused:
            if self.q_norm is not None and self.k_norm is not None:
                _fused().qk_norm_rope_(qkv, cos, sin, self.num_heads, self.num_kv_heads, self.head_dim,
                                       self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, cache)
            else:
                _fused().rope_(qkv, cos, sin, self.num_heads, self.num_kv_heads, self.head_dim, cache)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        if not fused:
            if self.q_norm is not None and self.k_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return q, k, v.view(-1, self.num_kv_heads, self.head_dim)

    def out(self, attn_out: torch.Tensor, pending: bool = False) -> torch.Tensor | PendingSum:
        """o_proj of this rank's heads, summed over ranks; the bias (row-parallel) is added once, after the sum.
        `pending`: the sum may be left to the norm that follows (a `PendingSum`)."""
        if not isinstance(self.o_proj, nn.Linear):  # a 4-bit linear (layers/quantized_linear.py), never sharded
            return self.o_proj(attn_out)
        if pending and self.o_proj.bias is None:
            return row_parallel_linear(attn_out, self.o_proj.weight, slot=0)
        out = all_reduce(F.linear(attn_out, self.o_proj.weight))
        return out if self.o_proj.bias is None else out + self.o_proj.bias

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        pending: bool = False,
    ) -> torch.Tensor | PendingSum:
        if fused_cpu(x) and self.q_norm is None and not meta.prefills and meta.num_decode_tokens == x.shape[0]:
            # A CPU decode step: RoPE, the cache write and attention in one op.
            qkv = self.qkv_proj(x)
            return self.out(cpu_ops().rope_paged_decode(
                qkv, cos, sin, kv_cache, meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens,
                self.num_heads, self.num_kv_heads, self.head_dim, self.attn.scale))
        if x.is_cuda:  # the fused RoPE kernel writes K and V into the cache
            q, k, v = self.qkv(x, cos, sin, cache=CacheWrite(kv_cache, meta.slot_mapping))
            return self.out(self.attn(q, k, v, kv_cache, meta, kv_written=True), pending)
        q, k, v = self.qkv(x, cos, sin)
        return self.out(self.attn(q, k, v, kv_cache, meta))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        intermediate = config.intermediate_size // tp_size()  # this rank's MLP channels
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, pending: bool = False) -> torch.Tensor | PendingSum:
        """`pending`: the sum over ranks may be left to the norm that follows (a `PendingSum`)."""
        gate_up = self.gate_up_proj(x)
        if gate_up.is_cuda and pending and isinstance(self.down_proj, nn.Linear):
            return row_parallel_linear(_fused().silu_mul(gate_up), self.down_proj.weight, slot=1)
        if gate_up.is_cuda:
            return all_reduce(self.down_proj(_fused().silu_mul(gate_up)))
        if fused_cpu(gate_up) and gate_up.is_contiguous():
            return all_reduce(self.down_proj(cpu_ops().silu_mul(gate_up)))
        gate, up = gate_up.chunk(2, dim=-1)
        return all_reduce(self.down_proj(F.silu(gate) * up))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        sparse = config.moe is not None and config.moe.is_sparse(layer_idx)
        self.mlp = SparseMoeBlock(config) if sparse else LlamaMLP(config)

    def forward(
        self,
        x: torch.Tensor | PendingSum,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        pending_sums: bool = False,
    ) -> tuple[torch.Tensor | PendingSum, torch.Tensor]:
        """`pending_sums`: the sub-blocks' row-parallel outputs may stay unsummed (`PendingSum`) for
        the next norm to sum; the caller then passes the returned output to `_norm` as well."""
        # The residual add is fused into the norms: x is the previous sub-block's output.
        if residual is None:
            assert isinstance(x, torch.Tensor), "the first layer's input is the embedding"
            residual = x
            x = _norm(self.input_layernorm, x)
        else:
            x, residual = _norm(self.input_layernorm, x, residual)
        attn_out = self.self_attn(x, cos, sin, kv_cache, meta, pending_sums)
        x, residual = _norm(self.post_attention_layernorm, attn_out, residual)
        if isinstance(self.mlp, LlamaMLP):
            return self.mlp(x, pending_sums), residual
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return self.embed_tokens(input_ids)
        # Ids outside this rank's rows contribute zeros; the sum over ranks is the full lookup.
        local = input_ids - self.vocab_start
        inside = (local >= 0) & (local < self.embed_tokens.num_embeddings)
        x = self.embed_tokens(local.clamp(0, self.embed_tokens.num_embeddings - 1))
        return all_reduce(x * inside.unsqueeze(-1).to(x.dtype))

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # Vocabulary-parallel: this rank's rows of the (padded) vocabulary.
        self.vocab_start, vocab_end = vocab_shard(config.vocab_size, tp_rank(), tp_size())
        self.embed_tokens = nn.Embedding(vocab_end - self.vocab_start, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        x = self._embed(input_ids)
        # RoPE angles once per step, shared by every layer.
        c = self.config
        cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta, x.dtype, c.rope_scaling)
        residual = None
        # With tensor parallelism on CUDA each norm sums the sub-block before it over the ranks.
        pending_sums = tp_size() > 1 and x.is_cuda
        out: torch.Tensor | PendingSum = x
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            out, residual = layer(out, residual, cos, sin, kv_cache, meta, pending_sums)
        x, _ = _norm(self.norm, out, residual)
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
        # A GGUF's quantized LM head stays in its blocks on the CPU (model_loader/gguf_quantized.py).
        self.lm_head: nn.Linear | GGUFLinear | None = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, self.model.embed_tokens.num_embeddings, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # int64 [T]
        positions: torch.Tensor,  # int64 [T]
        attn_metadata: AttentionMetadata,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:  # [T, hidden], after the final norm
        return self.model(input_ids, positions, attn_metadata, kv_caches)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, vocab] for the selected hidden states [N, hidden] (under tensor
        parallelism on CUDA, ranks other than 0 may get only their vocabulary shard's columns)."""
        if isinstance(self.lm_head, GGUFLinear):  # the file's blocks, on the CPU
            return self.lm_head(hidden).float()
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if hidden.is_cuda and hidden.dtype != torch.float32:
            # Logits rounded to bf16 (8 mantissa bits: steps of 0.125 between 16 and 32) often
            # tie the top tokens exactly; keep the GEMM's float32 accumulators instead.
            if tp_size() == 1:
                return torch.mm(hidden, weight.t(), out_dtype=torch.float32)
            # Each rank scored its vocabulary rows; rank 0, which samples, gets the whole
            # (unpadded) row; other ranks may get their own columns.
            return vocab_parallel_logits(hidden, weight)[:, : self.config.vocab_size]
        logits = F.linear(hidden, weight).float()
        if tp_size() == 1:
            return logits
        return all_gather_last_dim(logits)[:, : self.config.vocab_size]

    def _shard_sizes(self, fused: str) -> list[int]:
        c = local_config(self.config, tp_size())
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
        shards_seen: dict[str, set] = {}
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (self.lm_head is None and name == "lm_head.weight"):
                continue
            tensor = shard_weight(name, tensor, tp_rank(), tp_size())
            slot = expert_weight_slot(name)
            if slot is not None:  # one expert's gate, up or down matrix, into the stacked experts
                try:
                    experts = cast(MoEExperts, self.get_submodule(slot.module))
                except AttributeError:
                    raise KeyError(f"unexpected weight {name!r}") from None
                target = f"{slot.module}.{experts.load_expert(slot.expert, slot.proj, tensor)}"
                seen = shards_seen.setdefault(target, set())
                seen.add((slot.expert, slot.proj))
                if len(seen) == experts.shards_of(target):
                    loaded.add(target)
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
