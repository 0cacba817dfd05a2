"""Triton paged attention on CUDA vs the CPU implementation run in float64.

Random scattered block tables; decodes and prefill chunks (fresh, with a cached prefix, with a
prefix ending mid-block, longer than one kernel tile) in one flat batch; several block sizes,
GQA ratios and head sizes.
"""

from __future__ import annotations

import pytest
import torch

from fastdeploy.model_executor.layers.attention import Attention
from fastdeploy.model_executor.layers.attention_metadata import AttentionMetadata, PrefillSeq

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

KVH = 2


def _scenario(
    decodes: list[int], prefills: list[tuple[int, int]], heads: int, head_dim: int, block_size: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """CPU float64 q, k_new, v_new, cache (prefixes filled, block 0 poisoned) and the step's metadata."""
    g = torch.Generator().manual_seed(seed)
    seqs = [(ctx, 1) for ctx in decodes] + prefills
    total_blocks = sum(-(-ctx // block_size) for ctx, _ in seqs) + 4
    free = (torch.randperm(total_blocks - 1, generator=g) + 1).tolist()  # block 0 backs table padding
    cache = torch.randn(2, total_blocks, block_size, KVH, head_dim, generator=g, dtype=torch.float64)
    cache[:, 0] = 1e3  # padded table entries point here and must never be read
    tables, slots, ks, vs = [], [], [], []
    for ctx, qlen in seqs:
        table = torch.tensor([free.pop() for _ in range(-(-ctx // block_size))])
        pos = torch.arange(ctx - qlen, ctx)
        slots.append(table[pos // block_size] * block_size + pos % block_size)
        ks.append(torch.randn(qlen, KVH, head_dim, generator=g, dtype=torch.float64))
        vs.append(torch.randn(qlen, KVH, head_dim, generator=g, dtype=torch.float64))
        tables.append(table)
    width = max((len(t) for t in tables[: len(decodes)]), default=0) + 2  # extra padded columns
    decode_tables = torch.zeros(len(decodes), width, dtype=torch.long)
    for i, t in enumerate(tables[: len(decodes)]):
        decode_tables[i, : len(t)] = t
    prefill_meta, start = [], len(decodes)
    for (ctx, qlen), table in zip(prefills, tables[len(decodes) :], strict=True):
        prefill_meta.append(PrefillSeq(start, qlen, ctx, table))
        start += qlen
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots),
        num_decode_tokens=len(decodes),
        decode_block_tables=decode_tables,
        decode_context_lens=torch.tensor(decodes, dtype=torch.long),
        prefills=prefill_meta,
        block_size=block_size,
    )
    q = torch.randn(start, heads, head_dim, generator=g, dtype=torch.float64)
    return q, torch.cat(ks), torch.cat(vs), cache, meta


def _to_cuda(meta: AttentionMetadata) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping.cuda(),
        num_decode_tokens=meta.num_decode_tokens,
        decode_block_tables=meta.decode_block_tables.cuda(),
        decode_context_lens=meta.decode_context_lens.cuda(),
        prefills=meta.prefills,
        block_size=meta.block_size,
    )


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double().cpu() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize(("group", "head_dim"), [(1, 64), (3, 64), (4, 128), (7, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_matches_cpu_float64(block_size: int, group: int, head_dim: int, dtype: torch.dtype) -> None:
    heads = KVH * group
    decodes = [1, 7, 33, 130, 257]
    prefills = [(40, 40), (100, 13), (47, 31), (300, 150), (5, 1)]
    q, k, v, cache, meta = _scenario(decodes, prefills, heads, head_dim, block_size, seed=block_size * group)
    attn = Attention(heads, KVH, head_dim, head_dim**-0.5)
    ref_cache = cache.clone()
    ref = attn(q, k, v, ref_cache, meta)

    gpu_cache = cache.to("cuda", dtype)
    out = attn(q.to("cuda", dtype), k.to("cuda", dtype), v.to("cuda", dtype), gpu_cache, _to_cuda(meta))
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    tol = 1e-5 if dtype == torch.float32 else 1.5e-2
    assert _rel_err(out, ref) < tol
    # Per row too: a wrong row must not hide in the norm of the others.
    row_err = (out.double().cpu() - ref).norm(dim=1) / ref.norm(dim=1)
    assert row_err.max().item() < 5 * tol
    # The step's K/V landed at slot_mapping, and nothing else in the cache changed.
    torch.testing.assert_close(gpu_cache.double().cpu(), ref_cache.to(dtype).double(), atol=0, rtol=0)


def test_decode_padding_rows_write_zeros() -> None:
    """A captured decode batch pads with context_len 0: those rows must be 0, not NaN."""
    from fastdeploy.model_executor.layers.triton_attention import paged_decode_attention

    heads, head_dim, block_size = 8, 128, 16
    cache = torch.randn(2, 4, block_size, KVH, head_dim, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(3, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    tables = torch.tensor([[1, 2], [3, 0], [0, 0]], device="cuda")
    lens = torch.tensor([20, 5, 0], device="cuda")
    paged_decode_attention(q, cache[0], cache[1], tables, lens, head_dim**-0.5, out)
    assert torch.isfinite(out[:2]).all()
    assert (out[2] == 0).all()
