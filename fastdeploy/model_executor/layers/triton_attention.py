"""Paged attention on CUDA in Triton: decode (one query per sequence) and chunked prefill.

One kernel serves both. A program owns one KV head and a tile of "query rows", a row being
one (token, query head) pair of that KV head's group: `row = token * GROUP + head_in_group`.
Packing the GROUP query heads that share a KV head into one tile reads each K/V block once
per group (GQA) and, for decode, fills the 16 rows a tensor-core dot needs with the group's
heads instead of padding. Keys are gathered token by token through the block table, so the
tile width (BLOCK_N) is independent of the cache's block size.

Causality is bottom-right aligned: a chunk's query `i` sits at position
`context_len - query_len + i` and sees keys `0 .. that position`. The new K/V are written to
the cache before the kernel runs, so every key comes from the cache.

Rows that see no key (padding rows of a captured decode batch, context_len 0) write zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

_DECODE_BLOCK_M = 16  # tensor-core dots need at least 16 rows
_PREFILL_BLOCK_M = 64
_BLOCK_N = 64


@triton.jit
def _paged_attention_kernel(
    Q, K, V, Out,  # Q/Out [T, H, D]; K/V [num_slots, KVH, D] (the cache's flat slot view)
    block_tables, q_starts, q_lens, context_lens, tile_seqs, tile_rows,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kt, stride_kh, stride_vt, stride_vh, stride_bt,
    scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, GROUP: tl.constexpr, KV_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_DECODE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    if IS_DECODE:
        # Sequence i is flat token i and its only query; no tile table needed (graph-capturable).
        seq = pid
        q_start = pid
        q_len = 1
        row0 = 0
    else:
        seq = tl.load(tile_seqs + pid)
        row0 = tl.load(tile_rows + pid)
        q_start = tl.load(q_starts + seq)
        q_len = tl.load(q_lens + seq)
    ctx = tl.load(context_lens + seq)

    rows = row0 + tl.arange(0, BLOCK_M)
    tok = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = tok < q_len
    q_pos = ctx - q_len + tok
    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM
    q_ptrs = Q + (q_start + tok).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    # Keys visible to the tile's last valid query; nothing past it is loaded.
    last_tok = tl.minimum((row0 + BLOCK_M - 1) // GROUP, q_len - 1)
    kv_end = ctx - q_len + last_tok + 1
    for start in range(0, kv_end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < kv_end
        block = tl.load(block_tables + seq.to(tl.int64) * stride_bt + n // KV_BLOCK, mask=n_ok, other=0)
        slot = block.to(tl.int64) * KV_BLOCK + n % KV_BLOCK
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(K + slot[:, None] * stride_kt + kv_head * stride_kh + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        visible = (n[None, :] <= q_pos[:, None]) & n_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no key yet keeps m = -inf; shift by 0 so exp() gives 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_shift[:, None])
        alpha = tl.exp(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + slot[:, None] * stride_vt + kv_head * stride_vh + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_ptrs = Out + (q_start + tok).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@dataclass
class PrefillTiles:
    """Device tensors describing a step's prefill chunks to the kernel; built once per step."""

    block_tables: torch.Tensor  # int32 [P, max_blocks], padded with 0
    q_starts: torch.Tensor  # int32 [P]: flat index of each chunk's first token
    q_lens: torch.Tensor  # int32 [P]
    context_lens: torch.Tensor  # int32 [P]: cached tokens after this step, chunk included
    tile_seqs: torch.Tensor  # int32 [num_tiles]: the chunk each program works on
    tile_rows: torch.Tensor  # int32 [num_tiles]: the program's first query row in its chunk

    @classmethod
    def build(cls, prefills: list, group: int, block_size: int, device: torch.device) -> PrefillTiles:
        """From `PrefillSeq`s; everything travels to the device in one copy."""
        num = len(prefills)
        width = max(-(-p.context_len // block_size) for p in prefills)
        tables = torch.zeros(num, width, dtype=torch.int32)
        tile_seqs: list[int] = []
        tile_rows: list[int] = []
        for i, p in enumerate(prefills):
            tables[i, : p.block_table.numel()] = p.block_table[:width].to(torch.int32).cpu()
            n_tiles = -(-(p.query_len * group) // _PREFILL_BLOCK_M)
            tile_seqs.extend([i] * n_tiles)
            tile_rows.extend(range(0, n_tiles * _PREFILL_BLOCK_M, _PREFILL_BLOCK_M))
        per_seq = torch.tensor([[p.query_start, p.query_len, p.context_len] for p in prefills], dtype=torch.int32)
        tiles = torch.tensor([tile_seqs, tile_rows], dtype=torch.int32)
        flat = torch.cat([tables.reshape(-1), per_seq.t().reshape(-1), tiles.reshape(-1)])
        flat = flat.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else flat.to(device)
        tables_d, per_seq_d, tiles_d = flat.split([tables.numel(), per_seq.numel(), tiles.numel()])
        per_seq_d = per_seq_d.view(3, num)
        tiles_d = tiles_d.view(2, -1)
        return cls(tables_d.view(num, width), per_seq_d[0], per_seq_d[1], per_seq_d[2], tiles_d[0], tiles_d[1])


def _launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    block_tables: torch.Tensor,
    q_starts: torch.Tensor | None,
    q_lens: torch.Tensor | None,
    context_lens: torch.Tensor,
    tile_seqs: torch.Tensor | None,
    tile_rows: torch.Tensor | None,
    num_programs: int,
    scale: float,
    is_decode: bool,
) -> None:
    _, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    k = k_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    v = v_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    group = num_heads // num_kv_heads
    block_m = _DECODE_BLOCK_M if is_decode else _PREFILL_BLOCK_M
    if is_decode and group > block_m:
        raise ValueError(f"decode kernel handles at most {block_m} query heads per KV head, got {group}")
    # Unused pointer arguments of the decode variant: any int tensor will do.
    q_starts = context_lens if q_starts is None else q_starts
    q_lens = context_lens if q_lens is None else q_lens
    tile_seqs = context_lens if tile_seqs is None else tile_seqs
    tile_rows = context_lens if tile_rows is None else tile_rows
    _paged_attention_kernel[(num_programs, num_kv_heads)](
        q, k, v, out,
        block_tables, q_starts, q_lens, context_lens, tile_seqs, tile_rows,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        block_tables.stride(0),
        scale,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(max(head_dim, 16)), GROUP=group, KV_BLOCK=block_size,
        BLOCK_M=block_m, BLOCK_N=_BLOCK_N, IS_DECODE=is_decode,
        # float32 runs are the exact path: no tf32 rounding in the dots.
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4, num_stages=2,
    )  # fmt: skip


def paged_decode_attention(
    q: torch.Tensor,  # [D, H, Dh]: one query per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, Dh]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # int [D, max_blocks]
    context_lens: torch.Tensor,  # int [D], the new token included; 0 = padding row (writes zeros)
    scale: float,
    out: torch.Tensor,  # [D, H, Dh], written in place
) -> None:
    """Decode attention; no host sync and fixed launch shape, so it can be captured in a CUDA graph."""
    _launch(q, k_cache, v_cache, out, block_tables, None, None, context_lens, None, None, q.shape[0], scale, True)


def paged_prefill_attention(
    q: torch.Tensor,  # [T, H, Dh]: the step's flat batch (chunks located by `tiles.q_starts`)
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tiles: PrefillTiles,
    scale: float,
    out: torch.Tensor,  # [T, H, Dh]: the chunks' rows are written in place
) -> None:
    """Causal attention of prefill chunks over their cached prefix plus themselves (varlen)."""
    _launch(q, k_cache, v_cache, out, tiles.block_tables, tiles.q_starts, tiles.q_lens, tiles.context_lens,
            tiles.tile_seqs, tiles.tile_rows, tiles.tile_seqs.numel(), scale, False)
