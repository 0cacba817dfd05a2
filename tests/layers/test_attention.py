"""Paged attention vs a dense float64 reference, with scattered (non-contiguous) blocks."""

from __future__ import annotations

import math

import torch

from fastdeploy.common.config import ModelConfig
from fastdeploy.model_executor.layers.attention import (
    Attention,
    allocate_kv_caches,
    kv_cache_bytes_per_block,
)
from fastdeploy.model_executor.layers.attention_metadata import AttentionMetadata, PrefillSeq

H, KVH, DH, BS, NUM_BLOCKS = 4, 2, 8, 4, 40


def _config() -> ModelConfig:
    return ModelConfig(
        architecture="llama", vocab_size=16, hidden_size=H * DH, intermediate_size=8, num_hidden_layers=3,
        num_attention_heads=H, num_key_value_heads=KVH, head_dim=DH, rms_norm_eps=1e-6, rope_theta=1e4,
        max_position_embeddings=128, tie_word_embeddings=True,
    )  # fmt: skip


def _dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
    """float64 softmax attention; query at position p sees keys 0..p. q [Q,H,D], k/v [K,KVH,D]."""
    q, k, v = q.double(), k.double(), v.double()
    k = k.repeat_interleave(H // KVH, dim=1)
    v = v.repeat_interleave(H // KVH, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(DH)
    visible = torch.arange(k.shape[0])[None, :] <= q_pos[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(q.shape[0], H * DH)


def test_allocation_and_sizing() -> None:
    cfg = _config()
    caches = allocate_kv_caches(cfg, num_blocks=5, block_size=BS, dtype=torch.float16, device="cpu")
    assert len(caches) == cfg.num_hidden_layers
    assert all(c.shape == (2, 5, BS, KVH, DH) and c.dtype == torch.float16 for c in caches)
    per_block = kv_cache_bytes_per_block(cfg, BS, torch.float16)
    assert per_block * 5 == sum(c.numel() * c.element_size() for c in caches)


def test_paged_attention_matches_dense_reference() -> None:
    g = torch.Generator().manual_seed(0)
    blocks = torch.randperm(NUM_BLOCKS, generator=g)[1:].tolist()  # block 0 is left for table padding
    # (context_len, query_len): 3 decodes, then a chunk with a cached prefix, a fresh prefill,
    # and a chunk whose prefix ends mid-block.
    decode_seqs = [(5, 1), (13, 1), (1, 1)]
    prefill_seqs = [(11, 4), (6, 6), (9, 7)]
    seqs = decode_seqs + prefill_seqs

    kv_cache = torch.zeros(2, NUM_BLOCKS, BS, KVH, DH)
    # Fill block 0 with garbage: padded decode table entries point at it and must be masked.
    kv_cache[:, 0] = 1e3
    tables, full_k, full_v, slots, queries, q_positions = [], [], [], [], [], []
    for ctx, qlen in seqs:
        n_blocks = -(-ctx // BS)
        table = torch.tensor([blocks.pop() for _ in range(n_blocks)])
        k = torch.randn(ctx, KVH, DH, generator=g)
        v = torch.randn(ctx, KVH, DH, generator=g)
        seq_slots = table[torch.arange(ctx) // BS] * BS + torch.arange(ctx) % BS
        # The prefix is already cached; the last `qlen` tokens arrive this step.
        kv_cache[0].view(-1, KVH, DH)[seq_slots[: ctx - qlen]] = k[: ctx - qlen]
        kv_cache[1].view(-1, KVH, DH)[seq_slots[: ctx - qlen]] = v[: ctx - qlen]
        tables.append(table)
        full_k.append(k)
        full_v.append(v)
        slots.append(seq_slots[ctx - qlen :])
        queries.append(torch.randn(qlen, H, DH, generator=g))
        q_positions.append(torch.arange(ctx - qlen, ctx))

    num_decode = len(decode_seqs)
    max_blocks = max(len(t) for t in tables[:num_decode])
    decode_tables = torch.zeros(num_decode, max_blocks, dtype=torch.long)
    for i, t in enumerate(tables[:num_decode]):
        decode_tables[i, : len(t)] = t
    prefills, start = [], num_decode
    for (ctx, qlen), table in zip(prefill_seqs, tables[num_decode:], strict=True):
        prefills.append(PrefillSeq(query_start=start, query_len=qlen, context_len=ctx, block_table=table))
        start += qlen
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots),
        num_decode_tokens=num_decode,
        decode_block_tables=decode_tables,
        decode_context_lens=torch.tensor([ctx for ctx, _ in decode_seqs]),
        prefills=prefills,
        block_size=BS,
    )
    q = torch.cat(queries)
    k_new = torch.cat([k[ctx - qlen :] for k, (ctx, qlen) in zip(full_k, seqs, strict=True)])
    v_new = torch.cat([v[ctx - qlen :] for v, (ctx, qlen) in zip(full_v, seqs, strict=True)])

    out = Attention(H, KVH, DH, DH**-0.5)(q, k_new, v_new, kv_cache, meta)

    expected = torch.cat(
        [_dense_reference(qs, k, v, pos) for qs, k, v, pos in zip(queries, full_k, full_v, q_positions, strict=True)]
    )
    assert out.shape == (q.shape[0], H * DH)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    # The step's K/V landed in the cache at slot_mapping.
    torch.testing.assert_close(kv_cache[0].view(-1, KVH, DH)[meta.slot_mapping], k_new)
    torch.testing.assert_close(kv_cache[1].view(-1, KVH, DH)[meta.slot_mapping], v_new)
