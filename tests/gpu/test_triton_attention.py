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


def _shared_prefix_batch(block_size: int, head_dim: int, group: int, seed: int, device: str, dtype: torch.dtype):
    """Decode rows that share cache blocks as the engine makes them: a prompt's n samples (its
    full blocks shared, then each sample's own blocks), one sequence's draft rows (one table,
    lengths one apart), lone rows and a padding row, the batch not a multiple of a tile. Also
    the same K/V with every row in blocks of its own (nothing shared), and the float64 rows."""
    g = torch.Generator().manual_seed(seed)
    heads = KVH * group
    # (shared prefix tokens, own tokens) per row; the same key = the same prefix blocks.
    layout = [("a", 200, 13), ("a", 200, 40), ("a", 200, 1), ("a", 200, 77), ("a", 200, 64), ("x", 0, 90),
              ("b", 128, 3), ("b", 128, 70), ("p", 0, 0), ("d", 150, 1), ("d", 150, 2), ("d", 150, 3),
              ("y", 0, 5), ("c", 300, 9), ("c", 300, 10)]
    prefix_blocks = {key: -(-tokens // block_size) for key, tokens, _ in layout}
    total = 1 + sum(prefix_blocks.values()) + sum(-(-(t + own) // block_size) + 1 for _, t, own in layout)
    total *= 2  # room for the unshared copy
    free = (torch.randperm(total - 1, generator=g) + 1).tolist()
    cache = torch.randn(2, total, block_size, KVH, head_dim, generator=g, dtype=torch.float64)
    cache[:, 0] = 1e3  # table padding points here and must never be read
    prefixes = {key: [free.pop() for _ in range(n)] for key, n in prefix_blocks.items()}
    shared_tables, own_tables, lens = [], [], []
    for key, tokens, own in layout:
        ctx = tokens + own if key != "p" else 0
        if key == "d":  # draft rows: one sequence, one table, one more token each
            if "d_tail" not in prefixes:
                prefixes["d_tail"] = [free.pop()]  # the block the last drafts may spill into
            table = (prefixes[key] + prefixes["d_tail"])[: -(-(tokens + 3) // block_size)]
        else:
            full = tokens // block_size  # a prefix's last partial block is each sample's own copy
            table = prefixes[key][:full] + [free.pop() for _ in range(-(-ctx // block_size) - full)]
            if full < len(prefixes[key]):
                cache[:, table[full]] = cache[:, prefixes[key][full]]
        shared_tables.append(table)
        lens.append(ctx)
        # The unshared copy: the same keys and values in blocks no other row uses.
        copy = [free.pop() for _ in table]
        for src, dst in zip(table, copy, strict=True):
            cache[:, dst] = cache[:, src]
        own_tables.append(copy)
    width = max(len(t) for t in shared_tables) + 2
    def pad(tables):
        out = torch.zeros(len(tables), width, dtype=torch.long)
        for i, t in enumerate(tables):
            out[i, : len(t)] = torch.tensor(t)
        return out
    q = torch.randn(len(layout), heads, head_dim, generator=g, dtype=torch.float64)
    lens_t = torch.tensor(lens)
    ref = Attention(heads, KVH, head_dim, head_dim**-0.5)._decode(q, cache[0], cache[1], AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long), num_decode_tokens=len(layout),
        decode_block_tables=pad(shared_tables), decode_context_lens=lens_t, prefills=[], block_size=block_size))
    to = {"device": device, "dtype": dtype}
    return (q.to(**to), cache.to(**to), pad(shared_tables).to(device), pad(own_tables).to(device),
            lens_t.to(device), ref)


def _check_shared_rows_against_rows_alone(group: int, head_dim: int, block_size: int, dtype: torch.dtype,
                                             device: str, exact: bool = True) -> None:
    from fastdeploy.model_executor.layers.triton_attention import paged_decode_attention

    q, cache, shared, alone, lens, ref = _shared_prefix_batch(block_size, head_dim, group, group * block_size,
                                                              device, dtype)
    out_shared = torch.full_like(q, float("nan"))
    out_alone = torch.full_like(q, float("nan"))
    paged_decode_attention(q, cache[0], cache[1], shared, lens, head_dim**-0.5, out_shared)
    paged_decode_attention(q, cache[0], cache[1], alone, lens, head_dim**-0.5, out_alone)
    if exact:
        assert torch.equal(out_shared, out_alone)
    else:
        torch.testing.assert_close(out_shared, out_alone, atol=1e-6, rtol=1e-6)
    assert (out_shared[lens == 0] == 0).all()
    live = (lens > 0).cpu()
    err = (out_shared.double().cpu() - ref)[live].flatten(1).norm(dim=1) / ref[live].flatten(1).norm(dim=1)
    assert err.max().item() < (1e-5 if dtype == torch.float32 else 3e-2)


@pytest.mark.parametrize(("group", "head_dim", "block_size"), [(4, 128, 16), (3, 64, 8), (2, 64, 32), (7, 128, 16)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_rows_sharing_a_prefix_give_the_bits_of_rows_alone(group, head_dim, block_size, dtype) -> None:
    """Rows that share prefix blocks are attended together (the prefix read once for the tile),
    and give exactly what the same rows give with every block their own; both match float64."""
    _check_shared_rows_against_rows_alone(group, head_dim, block_size, dtype, "cuda")
    torch.cuda.synchronize()


def decode_checks_on(device: torch.device, cases: int) -> None:
    """The shared-prefix check in float32 for `cases` head layouts, for the CPU under Triton's
    interpreter (tests/layers/test_decode_attention_interpreted.py). There the dots are NumPy's,
    whose bits depend on where a row sits in the tile, so rows together and alone are compared to
    float32 rounding, not to the bit (the GPU test does that)."""
    layouts = [(4, 64, 16), (3, 32, 8), (1, 32, 32), (7, 64, 16)][:cases]
    for group, head_dim, block_size in layouts:
        _check_shared_rows_against_rows_alone(group, head_dim, block_size, torch.float32, device.type, exact=False)


def _compiled_variants(kernel) -> int:
    """Variants of a Triton kernel compiled (or loaded from the disk cache) in this process."""
    caches = getattr(kernel, "device_caches", None)
    assert caches is not None, "this Triton keeps no per-device kernel cache to count"
    return sum(len(entry[0]) for entry in caches.values())


def _run_step_shapes(device: str) -> None:
    """Decode and prefill calls whose row counts, table widths and metadata offsets (inside one
    buffer, as a step's upload lays them out) change from call to call."""
    from fastdeploy.model_executor.layers import triton_attention as ta

    g = torch.Generator().manual_seed(7)
    heads, head_dim, block_size, blocks = 4 * KVH, 64, 16, 96
    k_cache = torch.randn(blocks, block_size, KVH, head_dim, generator=g).to(device, torch.bfloat16)
    v_cache = torch.randn(blocks, block_size, KVH, head_dim, generator=g).to(device, torch.bfloat16)
    for rows, width, offset in [(1, 1, 0), (16, 16, 1), (17, 3, 2), (3, 17, 3), (32, 2, 5)]:
        buf = torch.zeros(offset + rows * width + rows, dtype=torch.int64)
        buf[offset:offset + rows * width] = torch.randint(blocks, (rows * width,), generator=g)
        buf[offset + rows * width:] = torch.randint(1, width * block_size + 1, (rows,), generator=g)
        buf = buf.to(device)
        tables = buf[offset:offset + rows * width].view(rows, width)
        context_lens = buf[offset + rows * width:]
        q = torch.randn(rows, heads, head_dim, generator=g).to(device, torch.bfloat16)
        ta.paged_decode_attention(q, k_cache, v_cache, tables, context_lens, head_dim**-0.5, torch.empty_like(q))
    for lens in [[(5, 5)], [(40, 17), (3, 3)], [(16, 1), (33, 32), (70, 9)], [(1, 1)] * 5]:
        prefills, start = [], 0
        for ctx, qlen in lens:
            table = torch.randint(blocks, (-(-ctx // block_size),), generator=g)
            prefills.append(PrefillSeq(start, qlen, ctx, table))
            start += qlen
        tiles = ta.PrefillTiles.build(prefills, heads // KVH, block_size, torch.device(device))
        q = torch.randn(start, heads, head_dim, generator=g).to(device, torch.bfloat16)
        ta.paged_prefill_attention(q, k_cache, v_cache, tiles, head_dim**-0.5, torch.empty_like(q))


def test_new_step_shapes_do_not_compile_the_attention_kernels_again() -> None:
    """A serving GPU meets new row counts, table widths and metadata offsets all the time; each
    attention kernel compiles once for them (Triton would compile again for each new
    divisibility by 16 and each new 16-byte alignment it specialised on: a GRPO-shaped load on an
    H100 spent 45 steps of 292 ms each compiling)."""
    from fastdeploy.model_executor.layers import triton_attention as ta

    kernels = (ta._paged_decode_kernel, ta._paged_prefill_kernel)
    before = [_compiled_variants(k) for k in kernels]
    _run_step_shapes("cuda")
    torch.cuda.synchronize()
    new = [_compiled_variants(k) - b for k, b in zip(kernels, before, strict=True)]
    assert new[0] <= 1 and new[1] <= 1, f"new compiled variants (decode, prefill): {new}"
