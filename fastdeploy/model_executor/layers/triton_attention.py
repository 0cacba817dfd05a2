"""Paged attention on CUDA in Triton: decode (one query per sequence) and chunked prefill.

In both kernels a program owns one KV head and a tile of "query rows", a row being one
(token, query head) pair of that KV head's group: `row = token * GROUP + head_in_group`.
Packing the GROUP query heads that share a KV head into one tile reads each K/V block once
per group (GQA) and, for decode, fills the 16 rows a tensor-core dot needs with the group's
heads (and the rows of sequences that share a prefix, below) instead of padding. Keys are
gathered token by token through the block table, so the tile width (BLOCK_N) is independent of
the cache's block size.

Causality is bottom-right aligned: a chunk's query `i` sits at position
`context_len - query_len + i` and sees keys `0 .. that position`. The new K/V are written to
the cache before the kernel runs, so every key comes from the cache.

Rows that see no key (padding rows of a captured decode batch, context_len 0) write zeros.

Decode has its own kernel, which reads a prefix that neighbouring rows share once for all of
them. The decode rows are cut into aligned tiles of `BLOCK_M // GROUP` rows (4 for 32 query heads
over 8 KV heads). When a tile's leading rows point at the same cache blocks (the n samples of
one prompt through the prefix cache, or the rows of one sequence's drafts), the tile's first
program attends all of them: it streams the shared keys once with every row's queries in the
tile, then each row's own keys after them, and the tile's other programs have nothing to do.
Otherwise each program attends its own row, as plain decode. The shared length is rounded down
to a multiple of BLOCK_N, so every row sees its keys in the same chunks, in the same order, as
it would alone, and each row's scores come from its own query only: the result is meant to be
the same to the bit (tests/gpu/test_triton_attention.py asserts it). The tiles are found on the
device from the block tables, so a captured graph needs no new inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

_DECODE_BLOCK_M = 16  # tensor-core dots need at least 16 rows
_PREFILL_BLOCK_M = 64
_BLOCK_N = 64
# The decode kernel's warps and pipeline stages (benchmarks/attention_tiles.py sweeps them with the
# tile width: the fastest at 64 and 256 rows on an H100; at one row 8 / 3 was 0.4 us faster).
_DECODE_WARPS = 4
_DECODE_STAGES = 2
_TABLE_CHUNK = 128  # block-table entries compared at a time when finding a shared prefix

# Triton compiles a kernel again for each new combination of its integer arguments' divisibility
# by 16 (and equality to 1) and of its pointers' 16-byte alignment. A step's row count and
# block-table width, and the offsets of its metadata in the one buffer that carries them to the
# device, change from step to step: specialised on, they cost a compile (hundreds of ms) in the
# middle of serving whenever a new combination turns up. The metadata is read once per program,
# so the hints are worth nothing there; the K/V and query pointers keep theirs.
_DECODE_VARYING = {"do_not_specialize": ["num_rows", "stride_bt"],
                   "do_not_specialize_on_alignment": ["block_tables", "context_lens"]}
_PREFILL_VARYING = {"do_not_specialize": ["stride_bt"],
                    "do_not_specialize_on_alignment": ["block_tables", "q_starts", "q_lens", "context_lens",
                                                       "tile_seqs", "tile_rows"]}


@triton.jit
def _shared_tokens(block_tables, context_lens, first, other, num_rows, stride_bt,
                   KV_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, TABLE_CHUNK: tl.constexpr):
    """Tokens rows `first` and `other` read from the same cache blocks, rounded down to a multiple
    of BLOCK_N; 0 when `other` is past the batch. Only blocks below both rows' lengths are compared
    (entries past a row's length are padding, stale in a graph's buffer)."""
    ok = other < num_rows
    ctx_a = tl.load(context_lens + first)
    ctx_b = tl.load(context_lens + other, mask=ok, other=0)
    limit = tl.minimum(ctx_a, ctx_b)
    num_blocks = (limit + KV_BLOCK - 1) // KV_BLOCK
    first_diff = num_blocks
    for start in range(0, num_blocks, TABLE_CHUNK):
        k = start + tl.arange(0, TABLE_CHUNK)
        k_ok = k < num_blocks
        a = tl.load(block_tables + first.to(tl.int64) * stride_bt + k, mask=k_ok, other=0)
        b = tl.load(block_tables + other.to(tl.int64) * stride_bt + k, mask=k_ok, other=0)
        first_diff = tl.minimum(first_diff, tl.min(tl.where(k_ok & (a != b), k, num_blocks)))
    same = tl.minimum(first_diff * KV_BLOCK, limit)
    return tl.where(ok, (same // BLOCK_N) * BLOCK_N, 0)


@triton.jit(**_DECODE_VARYING)
def _paged_decode_kernel(
    Q, K, V, Out,  # Q/Out [D, H, Dh], one query per row; K/V [num_slots, KVH, D] (flat slot view)
    block_tables, context_lens, num_rows,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kt, stride_kh, stride_vt, stride_vh, stride_bt,
    scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, GROUP: tl.constexpr, KV_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TILE: tl.constexpr, TABLE_CHUNK: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    # The run of leading rows of this program's tile that share a prefix with the tile's first row.
    tile0 = (pid // TILE) * TILE
    run = tl.full([], 1, tl.int32)
    in_run = tl.full([], 1, tl.int32)
    shared = tl.load(context_lens + tile0)
    for j in tl.static_range(1, TILE):
        same = _shared_tokens(block_tables, context_lens, tile0, tile0 + j, num_rows, stride_bt,
                              KV_BLOCK, BLOCK_N, TABLE_CHUNK)
        in_run = in_run * (same > 0).to(tl.int32)
        run += in_run
        shared = tl.where(in_run > 0, tl.minimum(shared, same), shared)
    # This program attends rows seq0 .. seq0 + num_seqs - 1: the whole run (its first program),
    # nothing (the run's other programs), or its own row (no run, or a row after the run).
    together = (run > 1) & (pid < tile0 + run)
    seq0 = tl.where(together, tile0, pid)
    num_seqs = tl.where(together, tl.where(pid == tile0, run, 0), 1)
    shared = tl.where(together & (pid == tile0), shared, 0)

    rows = tl.arange(0, BLOCK_M)
    row_seq = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = row_seq < num_seqs
    seq_of_row = (seq0 + row_seq).to(tl.int64)
    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM
    q = tl.load(Q + seq_of_row[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    # Row j's keys: the shared ones through seq0's table, then its own from `shared` on. A chunk a
    # row does not take part in gives it -inf scores, which leave its running max, sum and
    # values unchanged.
    for j in range(-1, num_seqs):
        seq = tl.where(j < 0, seq0, seq0 + j).to(tl.int64)
        lo = tl.where(j < 0, 0, shared)
        hi = tl.where(j < 0, shared, tl.load(context_lens + seq))
        takes_part = tl.where(j < 0, row_ok, row_seq == j)
        for start in range(lo, hi, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            n_ok = n < hi
            block = tl.load(block_tables + seq * stride_bt + n // KV_BLOCK, mask=n_ok, other=0)
            slot = block.to(tl.int64) * KV_BLOCK + n % KV_BLOCK
            kv_mask = n_ok[:, None] & d_ok[None, :]
            k = tl.load(K + slot[:, None] * stride_kt + kv_head * stride_kh + d[None, :], mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            s = tl.where(takes_part[:, None] & n_ok[None, :], s, float("-inf"))
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
    o_ptrs = Out + seq_of_row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit(**_PREFILL_VARYING)
def _paged_prefill_kernel(
    Q, K, V, Out,  # Q/Out [T, H, D]; K/V [num_slots, KVH, D] (the cache's flat slot view)
    block_tables, q_starts, q_lens, context_lens, tile_seqs, tile_rows,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kt, stride_kh, stride_vt, stride_vh, stride_bt,
    scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, GROUP: tl.constexpr, KV_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
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


def _kv_views(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The caches [blocks, block_size, KVH, Dh] as flat slots [blocks * block_size, KVH, Dh]."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    return (k_cache.view(num_blocks * block_size, num_kv_heads, head_dim),
            v_cache.view(num_blocks * block_size, num_kv_heads, head_dim))


def _precision(q: torch.Tensor) -> str:
    return "ieee" if q.dtype == torch.float32 else "tf32"  # float32 runs are the exact path: no tf32


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
    num_rows, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    if group > _DECODE_BLOCK_M:
        raise ValueError(f"decode kernel handles at most {_DECODE_BLOCK_M} query heads per KV head, got {group}")
    k, v = _kv_views(k_cache, v_cache)
    _paged_decode_kernel[(num_rows, num_kv_heads)](
        q, k, v, out, block_tables, context_lens, num_rows,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        block_tables.stride(0),
        scale,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(max(head_dim, 16)), GROUP=group, KV_BLOCK=block_size,
        BLOCK_M=_DECODE_BLOCK_M, BLOCK_N=_BLOCK_N, TILE=_DECODE_BLOCK_M // group, TABLE_CHUNK=_TABLE_CHUNK,
        PRECISION=_precision(q), num_warps=_DECODE_WARPS, num_stages=_DECODE_STAGES,
    )  # fmt: skip


def paged_prefill_attention(
    q: torch.Tensor,  # [T, H, Dh]: the step's flat batch (chunks located by `tiles.q_starts`)
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tiles: PrefillTiles,
    scale: float,
    out: torch.Tensor,  # [T, H, Dh]: the chunks' rows are written in place
) -> None:
    """Causal attention of prefill chunks over their cached prefix plus themselves (varlen)."""
    _, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    k, v = _kv_views(k_cache, v_cache)
    _paged_prefill_kernel[(tiles.tile_seqs.numel(), num_kv_heads)](
        q, k, v, out,
        tiles.block_tables, tiles.q_starts, tiles.q_lens, tiles.context_lens, tiles.tile_seqs, tiles.tile_rows,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        tiles.block_tables.stride(0),
        scale,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(max(head_dim, 16)), GROUP=num_heads // num_kv_heads,
        KV_BLOCK=block_size, BLOCK_M=_PREFILL_BLOCK_M, BLOCK_N=_BLOCK_N, PRECISION=_precision(q),
        num_warps=4, num_stages=2,
    )  # fmt: skip
