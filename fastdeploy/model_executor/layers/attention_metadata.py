"""Per-step attention metadata built by the model runner and read by every attention layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from fastdeploy.model_executor.layers.triton_attention import PrefillTiles


@dataclass
class PrefillSeq:
    """One sequence running a prefill chunk this step.

    Its `query_len` tokens sit at `query_start` in the flat token batch and hold
    positions `context_len - query_len .. context_len - 1`.
    """

    query_start: int
    query_len: int
    context_len: int  # tokens in the KV cache after this step, chunk included
    block_table: torch.Tensor  # int64 [ceil(context_len / block_size)], on the host


@dataclass
class AttentionMetadata:
    """Where each token's K/V goes and what each query attends to.

    The flat batch holds `num_decode_tokens` decode tokens first (one per
    decoding sequence), then the prefill chunks in `prefills` order.
    """

    slot_mapping: torch.Tensor  # int64 [T]: block_id * block_size + offset per token
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # int64 [D, max_blocks], padded with 0
    decode_context_lens: torch.Tensor  # int64 [D], new token included
    prefills: list[PrefillSeq]
    block_size: int
    # CUDA: the prefills as kernel inputs, built by the first attention layer of the step.
    gpu_prefill_tiles: PrefillTiles | None = None


@dataclass(frozen=True)
class CacheWrite:
    """Where the fused RoPE kernels (CUDA) also write each token's K and V: one layer's paged cache
    [2, blocks, block_size, kv_heads, head_dim] (contiguous) at `slot_mapping` [T]. This saves the
    two scatters that otherwise follow in `Attention`, two launches a layer."""

    kv_cache: torch.Tensor
    slot_mapping: torch.Tensor
