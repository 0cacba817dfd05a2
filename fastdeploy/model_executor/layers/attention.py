"""Paged attention over a block-structured KV cache, following `AttentionMetadata`.

Cache layout, per layer: ONE tensor `[2, num_blocks, block_size, num_kv_heads, head_dim]`
(index 0 = K, 1 = V). Token slot `s` lives at block `s // block_size`, offset `s % block_size`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fastdeploy.common.config import ModelConfig
from fastdeploy.model_executor.layers.attention_metadata import AttentionMetadata


def allocate_kv_caches(
    config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: str | torch.device
) -> list[torch.Tensor]:
    """One zeroed `[2, num_blocks, block_size, num_kv_heads, head_dim]` tensor per layer."""
    shape = (2, num_blocks, block_size, config.num_key_value_heads, config.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]


def kv_cache_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block id costs across ALL layers (K and V), for sizing the pool."""
    elem = torch.empty((), dtype=dtype).element_size()
    per_layer = 2 * block_size * config.num_key_value_heads * config.head_dim * elem
    return per_layer * config.num_hidden_layers


def _gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """cache[block_ids] along dim 0.

    index_select, not advanced indexing: on CPU, `cache[ids]` on a view of the
    [2, ...] pool costs milliseconds per call (measured 7.8 ms vs 8 us for 2 blocks).
    """
    return cache.index_select(0, block_ids)


class Attention(nn.Module):
    """Writes this step's K/V into the paged cache, then attends decode and prefill tokens."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        kv_written: bool = False,  # CUDA: the fused RoPE kernel already wrote k and v into the cache
    ) -> torch.Tensor:  # [T, num_heads * head_dim]
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        if q.is_cuda:
            return self._forward_triton(q, k, v, k_cache, v_cache, meta, kv_written)
        # Scatter the new K/V first so every query below can read its own token from the cache.
        k_cache.view(-1, self.num_kv_heads, self.head_dim)[meta.slot_mapping] = k.to(k_cache.dtype)
        v_cache.view(-1, self.num_kv_heads, self.head_dim)[meta.slot_mapping] = v.to(v_cache.dtype)

        out = torch.empty_like(q)
        num_decode = meta.num_decode_tokens
        if num_decode > 0:
            out[:num_decode] = self._decode(q[:num_decode], k_cache, v_cache, meta)
        for p in meta.prefills:
            sl = slice(p.query_start, p.query_start + p.query_len)
            out[sl] = self._prefill(q[sl], k[sl], v[sl], k_cache, v_cache, p.context_len, p.block_table)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)

    def _forward_triton(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        kv_written: bool,
    ) -> torch.Tensor:
        """CUDA: Triton paged kernels; no host sync, so decode steps can be captured in a CUDA graph."""
        from fastdeploy.model_executor.layers import triton_attention  # triton is optional on CPU hosts

        if not kv_written:
            # index_copy_ rather than index_put_: a plain scatter with no sort or sync, graph-capturable.
            k_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
            v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
        q = q.to(k_cache.dtype)
        out = torch.empty_like(q)
        num_decode = meta.num_decode_tokens
        if num_decode > 0:
            triton_attention.paged_decode_attention(
                q[:num_decode], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
                self.scale, out[:num_decode],
            )  # fmt: skip
        if meta.prefills:
            if meta.gpu_prefill_tiles is None:  # the first layer builds them; the others reuse them
                meta.gpu_prefill_tiles = triton_attention.PrefillTiles.build(
                    meta.prefills, self.num_heads // self.num_kv_heads, meta.block_size, q.device
                )
            triton_attention.paged_prefill_attention(q, k_cache, v_cache, meta.gpu_prefill_tiles, self.scale, out)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)

    def _decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """All decode tokens (one per sequence) in one batched matmul-softmax-matmul.

        Plain bmm rather than SDPA: with one query per sequence there is nothing for a
        fused kernel to tile, and on CPU SDPA paid ~4 ms per call the first time it saw
        each new key length (measured: 1.9 s of a 16-token run), i.e. every 16 tokens.
        """
        block_tables = meta.decode_block_tables  # [D, max_blocks]
        num_seqs, max_blocks = block_tables.shape
        max_len = max_blocks * meta.block_size
        group = self.num_heads // self.num_kv_heads
        flat_tables = block_tables.reshape(-1)
        # [D, KVH, L, Dh]: each sequence's blocks gathered contiguously.
        k = _gather_blocks(k_cache, flat_tables).reshape(num_seqs, max_len, self.num_kv_heads, self.head_dim)
        v = _gather_blocks(v_cache, flat_tables).reshape(num_seqs, max_len, self.num_kv_heads, self.head_dim)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        # GQA without copying K/V: the query heads of a KV head form its G query rows.
        qg = q.to(k.dtype).reshape(num_seqs, self.num_kv_heads, group, self.head_dim)
        scores = torch.matmul(qg, k.transpose(2, 3)).mul_(self.scale)  # [D, KVH, G, L] (fp32 on CPU)
        # Padded table entries point at block 0 (someone else's data): mask everything past the length.
        pos = torch.arange(max_len, device=q.device)
        pad = pos[None, :] >= meta.decode_context_lens[:, None].to(q.device)  # [D, L]
        scores.masked_fill_(pad[:, None, None, :], float("-inf"))
        o = torch.matmul(torch.softmax(scores.float(), dim=-1).to(v.dtype), v)  # [D, KVH, G, Dh]
        return o.reshape(num_seqs, self.num_heads, self.head_dim).to(q.dtype)

    def _prefill(
        self,
        q: torch.Tensor,  # [Q, H, Dh]
        k_new: torch.Tensor,  # [Q, KVH, Dh]
        v_new: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        context_len: int,
        block_table: torch.Tensor,
    ) -> torch.Tensor:
        """One prefill chunk: causal attention over its cached prefix plus itself."""
        query_len = q.shape[0]
        if context_len == query_len:
            # No prefix: the chunk's own K/V are everything, no need to gather from the cache.
            k, v, mask, causal = k_new.to(k_cache.dtype), v_new.to(v_cache.dtype), None, True
        else:
            bs = k_cache.shape[1]
            blocks = block_table[: (context_len + bs - 1) // bs]
            k = _gather_blocks(k_cache, blocks).reshape(-1, self.num_kv_heads, self.head_dim)[:context_len]
            v = _gather_blocks(v_cache, blocks).reshape(-1, self.num_kv_heads, self.head_dim)[:context_len]
            # Bottom-right aligned causal mask: query i sits at position context_len - query_len + i.
            q_pos = torch.arange(context_len - query_len, context_len, device=q.device)
            k_pos = torch.arange(context_len, device=q.device)
            mask, causal = k_pos[None, :] <= q_pos[:, None], False
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).to(k.dtype),  # [H, Q, Dh]
            k.transpose(0, 1),  # [KVH, K, Dh]
            v.transpose(0, 1),
            attn_mask=mask,
            is_causal=causal,
            scale=self.scale,
            enable_gqa=True,
        )
        return o.transpose(0, 1).to(q.dtype)
