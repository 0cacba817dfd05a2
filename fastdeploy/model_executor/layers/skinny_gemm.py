"""`x @ weight.T` for decode-sized batches on CUDA (Triton): few rows against a large weight, where
the time is the weight's read from memory.

With few output tiles per weight (a tensor-parallel rank's o_proj: 4,096 outputs), one program per
tile leaves SMs idle or streams long K loops; here the K dimension is split among programs as
well (`split_k`). Each program writes its float32 partial tile to a workspace; the last program of
a tile to finish (a per-tile counter) adds the partials in split order and writes the result, so
the sum is the same bits on every run, and resets the counter for the next call (CUDA graphs
replay it as is).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 4


@triton.jit
def _skinny_gemm_kernel(
    X, W, Y, Partials, Counters, M, N, K, stride_x, stride_y, k_per_split,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT_K: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    m_ok = rm < M
    n_ok = rn < N
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    x_ptrs = X + rm[:, None].to(tl.int64) * stride_x + (k_start + rk)[None, :]
    w_ptrs = W + rn[:, None].to(tl.int64) * K + (k_start + rk)[None, :]
    for k in range(k_start, k_end, BK):
        k_ok = (k + rk) < k_end
        x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w))
        x_ptrs += BK
        w_ptrs += BK
    out_mask = m_ok[:, None] & n_ok[None, :]
    y_ptrs = Y + rm[:, None].to(tl.int64) * stride_y + rn[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=out_mask)
    else:
        m_pad = tl.num_programs(2) * BM
        tile_at = rm[:, None].to(tl.int64) * N + rn[None, :]
        tl.store(Partials + pid_k * m_pad * N + tile_at, acc, mask=out_mask)
        # Every thread's partial is stored before one thread counts the program in (release:
        # the last program to count sees every partial of the tile).
        tl.debug_barrier()
        tile = pid_m * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(Counters + tile, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            total = tl.zeros([BM, BN], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                # Past L1 (".cg"): other programs wrote these partials.
                total += tl.load(Partials + s * m_pad * N + tile_at, mask=out_mask, other=0.0, cache_modifier=".cg")
            tl.store(y_ptrs, total.to(Y.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(Counters + tile, 0)


class SkinnyGemm:
    """Workspace and counters of one device; `__call__` computes `x @ weight.T` into `out`."""

    MAX_TILES = 1 << 16

    def __init__(self, device: torch.device, workspace_bytes: int = 64 << 20) -> None:
        self.partials = torch.empty(workspace_bytes // 4, dtype=torch.float32, device=device)
        self.counters = torch.zeros(self.MAX_TILES, dtype=torch.int32, device=device)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, config: SkinnyConfig,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        m, k = x.shape
        n = weight.shape[0]
        assert weight.shape[1] == k and weight.is_contiguous() and x.stride(1) == 1
        if out is None:
            out = torch.empty((m, n), dtype=x.dtype, device=x.device)
        block_m = max(16, triton.next_power_of_2(min(m, 64)))
        k_per_split = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k) * config.block_k
        split_k = triton.cdiv(k, k_per_split)
        grid = (triton.cdiv(n, config.block_n), split_k, triton.cdiv(m, block_m))
        if split_k > 1:
            assert grid[0] * grid[2] <= self.MAX_TILES
            assert split_k * grid[2] * block_m * n <= self.partials.numel(), "the workspace holds every partial"
        _skinny_gemm_kernel[grid](
            x, weight, out, self.partials, self.counters, m, n, k, x.stride(0), out.stride(0), k_per_split,
            BM=block_m, BN=config.block_n, BK=config.block_k, SPLIT_K=split_k,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )  # fmt: skip
        return out
