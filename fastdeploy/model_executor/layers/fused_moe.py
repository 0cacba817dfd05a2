"""Fused MoE on CUDA (Triton): (token, expert) pairs sorted by expert, then two grouped GEMMs.

`moe.route` and `moe.moe_reference` are the specification: for each token, the router-weighted
sum over its top-k experts of down(silu(gate(x)) * up(x)). `fused_topk` is the routing in one
kernel. Then, for T tokens and k experts each (n = T*k pairs, pair p = token p // k, slot p % k):

1. align: the pairs are grouped by expert into `sorted_pairs`, each expert's run padded to a
   multiple of BLOCK_M (padding entries hold n, "no pair"), with the expert of every BLOCK_M
   block in `block_expert` and the padded total in `total`. Ranks inside an expert come from
   atomics, so their order varies from run to run; each output row depends only on its own
   pair, so results do not.
2. GEMM 1: for each block, rows x[pair // k] times its expert's w13 [2I, H] -> gate_up [n, 2I].
3. silu(gate) * up -> [n, I] (`triton_fused.silu_mul`).
4. GEMM 2: rows of 3 times the expert's w2 [H, I], times the pair's router weight -> [n, H].
5. the k rows of each token summed -> [T, H].

Everything has a shape fixed by T (the padded buffers are sized for the worst case) and the
device reads `total` itself, so a decode step has no host sync and replays in a CUDA graph.
Each expert's weights are read once per BLOCK_M rows routed to it: at decode sizes (a few
rows per expert) the GEMMs stream the touched experts' weights once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fastdeploy.model_executor.layers.triton_fused import silu_mul


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def gemm_config(num_pairs: int, num_experts: int, dtype: torch.dtype) -> GemmConfig:
    """Tiles by the average rows per expert: small BLOCK_M while each expert sees a few rows (decode),
    larger tiles once the GEMMs are compute-bound (prefill). float32 (tests) halves the stages to fit
    shared memory."""
    per_expert = num_pairs / num_experts
    if per_expert <= 8:
        cfg = GemmConfig(16, 64, 128, 4, 4)
    elif per_expert <= 24:
        cfg = GemmConfig(32, 64, 128, 4, 4)
    else:
        cfg = GemmConfig(64, 128, 64, 8, 3)
    if dtype == torch.float32:
        cfg = GemmConfig(cfg.block_m, cfg.block_n, cfg.block_k // 2, cfg.num_warps, 2)
    return cfg


def padded_pairs(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound of the padded length: at most min(n, E) experts are non-empty, each adds < BLOCK_M."""
    bound = num_pairs + min(num_pairs, num_experts) * (block_m - 1)
    return triton.cdiv(bound, block_m) * block_m


@triton.jit
def _topk_softmax_kernel(
    Logits, Weights, Ids, stride_l, num_experts,
    TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    """One row: softmax over the experts in float32, the TOP_K largest (ties: lowest id), optionally renormalised."""
    row = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    ok = e < num_experts
    x = tl.load(Logits + row * stride_l + e, mask=ok, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, 0))
    p = tl.where(ok, p / tl.sum(p, 0), -1.0)
    total = 1.0
    if RENORMALIZE:  # a first pass for the sum of the chosen probabilities
        total = 0.0
        rest = p
        for _ in tl.static_range(TOP_K):
            best = tl.max(rest, 0)
            total += best
            rest = tl.where(e == tl.min(tl.where(rest == best, e, BLOCK_E), 0), -1.0, rest)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, 0)
        idx = tl.min(tl.where(p == best, e, BLOCK_E), 0)
        tl.store(Weights + row * TOP_K + j, (best / total).to(Weights.dtype.element_ty))
        tl.store(Ids + row * TOP_K + j, idx.to(tl.int64))
        p = tl.where(e == idx, -1.0, p)


def fused_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe.route` in one kernel: weights [T, k] in the logits' dtype, expert ids int64 [T, k], largest first."""
    tokens, num_experts = router_logits.shape
    weights = torch.empty(tokens, top_k, dtype=router_logits.dtype, device=router_logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=router_logits.device)
    _topk_softmax_kernel[(tokens,)](
        router_logits, weights, ids, router_logits.stride(0), num_experts,
        TOP_K=top_k, RENORMALIZE=renormalize, BLOCK_E=triton.next_power_of_2(num_experts), num_warps=1,
    )  # fmt: skip
    return weights, ids


@triton.jit
def _rank_kernel(Ids, Counts, Rank, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    expert = tl.load(Ids + offs, mask=ok, other=0)
    # Each pair takes the next free place of its expert; the returned old count is its rank.
    rank = tl.atomic_add(Counts + expert, 1, mask=ok)
    tl.store(Rank + offs, rank, mask=ok)


@triton.jit
def _scatter_kernel(
    Ids, Rank, Counts, Start, Sorted, BlockExpert, Total, n, num_experts, padded_len,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK: tl.constexpr, BLOCK_B: tl.constexpr,
):  # fmt: skip
    """One program: padded offsets per expert, the expert of every block, then each pair in its place."""
    e = tl.arange(0, BLOCK_E)
    e_ok = e < num_experts
    counts = tl.load(Counts + e, mask=e_ok, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, 0)
    start = end - padded
    tl.store(Start + e, start, mask=e_ok)
    tl.store(Total, tl.sum(padded, 0))
    for b0 in range(0, padded_len // BLOCK_M, BLOCK_B):
        blocks = b0 + tl.arange(0, BLOCK_B)
        # A block's expert: how many experts' runs end at or before the block's first row.
        below = (end[None, :] <= (blocks * BLOCK_M)[:, None]) & e_ok[None, :]
        expert = tl.minimum(tl.sum(below.to(tl.int32), 1), num_experts - 1)
        tl.store(BlockExpert + blocks, expert, mask=blocks < padded_len // BLOCK_M)
    for p0 in range(0, padded_len, BLOCK):
        offs = p0 + tl.arange(0, BLOCK)
        tl.store(Sorted + offs, tl.zeros([BLOCK], dtype=tl.int32) + n, mask=offs < padded_len)
    tl.debug_barrier()  # Start and the padding writes above are visible to every thread below
    for p0 in range(0, n, BLOCK):
        offs = p0 + tl.arange(0, BLOCK)
        ok = offs < n
        expert = tl.load(Ids + offs, mask=ok, other=0)
        dest = tl.load(Start + expert, mask=ok, other=0) + tl.load(Rank + offs, mask=ok, other=0)
        tl.store(Sorted + dest, offs.to(tl.int32), mask=ok)


@dataclass
class Alignment:
    """Pairs grouped by expert (see the module docstring), all on the device."""

    sorted_pairs: torch.Tensor  # int32 [padded_len]: pair index, or n for padding
    block_expert: torch.Tensor  # int32 [padded_len / block_m]
    total: torch.Tensor  # int32 [1]: padded rows in use; blocks past it are skipped
    block_m: int


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    flat = topk_ids.reshape(-1)
    n = flat.numel()
    padded_len = padded_pairs(n, num_experts, block_m)
    dev = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int32, device=dev)
    rank = torch.empty(n, dtype=torch.int32, device=dev)
    start = torch.empty(num_experts, dtype=torch.int32, device=dev)
    sorted_pairs = torch.empty(padded_len, dtype=torch.int32, device=dev)
    block_expert = torch.empty(padded_len // block_m, dtype=torch.int32, device=dev)
    total = torch.empty(1, dtype=torch.int32, device=dev)
    block = 1024
    _rank_kernel[(triton.cdiv(n, block),)](flat, counts, rank, n, BLOCK=block, num_warps=4)
    _scatter_kernel[(1,)](
        flat, rank, counts, start, sorted_pairs, block_expert, total, n, num_experts, padded_len,
        BLOCK_M=block_m, BLOCK_E=triton.next_power_of_2(num_experts), BLOCK=block, BLOCK_B=32, num_warps=4,
    )  # fmt: skip
    return Alignment(sorted_pairs, block_expert, total, block_m)


@triton.jit
def _grouped_gemm_kernel(
    A, W, Out, Weights, Sorted, BlockExpert, Total,
    N, K, n_pairs, top_k,
    stride_am, stride_we, stride_wn, stride_om,
    ROWS_ARE_TOKENS: tl.constexpr, MUL_WEIGHTS: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Out[p, :] = A[row(p), :] @ W[expert(p)].T (times Weights[p]) for the pairs p of one block."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    if pid_m * BLOCK_M >= tl.load(Total):
        return
    pairs = tl.load(Sorted + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < n_pairs
    rows = (pairs // top_k) if ROWS_ARE_TOKENS else pairs
    rows = tl.where(valid, rows, 0).to(tl.int64)
    expert = tl.load(BlockExpert + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    a_ptrs = A + rows[:, None] * stride_am + offs_k[None, :]
    w_ptrs = W + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - k0 * BLOCK_K
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if MUL_WEIGHTS:
        acc = acc * tl.load(Weights + pairs, mask=valid, other=0.0).to(tl.float32)[:, None]
    out_ptrs = Out + pairs[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(Out.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


def grouped_gemm(
    a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, alignment: Alignment, cfg: GemmConfig, top_k: int,
    rows_are_tokens: bool, weights: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """out [n, N] = per pair, a's row (token p // top_k, or pair p) @ w[expert].T; w: [E, N, K] contiguous."""
    n_pairs = out.shape[0]
    num_out, k_dim = w.shape[1], w.shape[2]
    grid = (alignment.sorted_pairs.numel() // cfg.block_m * triton.cdiv(num_out, cfg.block_n),)
    _grouped_gemm_kernel[grid](
        a, w, out, weights if weights is not None else out, alignment.sorted_pairs, alignment.block_expert,
        alignment.total, num_out, k_dim, n_pairs, top_k, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        ROWS_ARE_TOKENS=rows_are_tokens, MUL_WEIGHTS=weights is not None, IEEE=a.dtype == torch.float32,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )  # fmt: skip


def fused_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """`moe.moe_reference` on CUDA: x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_* [T, k] -> [T, H]."""
    x = x.contiguous()  # the GEMM walks rows with unit column stride
    tokens, hidden = x.shape
    num_experts, top_k = w13.shape[0], topk_ids.shape[1]
    n = tokens * top_k
    cfg = gemm_config(n, num_experts, x.dtype)
    alignment = align(topk_ids, num_experts, cfg.block_m)
    gate_up = torch.empty(n, w13.shape[1], dtype=x.dtype, device=x.device)
    grouped_gemm(x, w13, gate_up, alignment, cfg, top_k, rows_are_tokens=True)
    act = silu_mul(gate_up)
    out = torch.empty(n, hidden, dtype=x.dtype, device=x.device)
    grouped_gemm(act, w2, out, alignment, cfg, top_k, rows_are_tokens=False, weights=topk_weights.reshape(-1))
    return out.view(tokens, top_k, hidden).sum(dim=1)
