"""Fused elementwise kernels for the CUDA decoder layer (Triton): residual add + RMSNorm, RoPE (with
Qwen3's per-head q/k RMSNorm before it), SiLU*mul.

In PyTorch each of these is a chain of 2-9 small kernels per layer; at decode batch sizes every
one of them costs a few microseconds of launch and tail however little it computes, which adds
up to milliseconds over 32 layers. Each kernel here is one pass over its data.

Numerics follow the PyTorch ops they replace (`layernorm.RMSNorm`, `rotary.apply_rope`):
the residual sum is rounded to the activation dtype before the norm reads it, the norm runs in
float32, the result is rounded before the weight multiplies it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastdeploy.model_executor.layers.attention_metadata import CacheWrite


@triton.jit
def _add_rms_norm_kernel(
    X, R, W, Out, ResOut, stride_x, stride_r, stride_o, stride_ro, n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(R + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(ResOut + row * stride_ro + cols, x, mask=ok)
    h = x.to(tl.float32)
    var = tl.sum(h * h, 0) / n_cols
    y = (h * tl.rsqrt(var + eps)).to(x.dtype)
    w = tl.load(W + cols, mask=ok, other=0.0)
    tl.store(Out + row * stride_o + cols, (w.to(tl.float32) * y.to(tl.float32)).to(Out.dtype.element_ty), mask=ok)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`RMSNorm.forward` in one kernel: norm(x) or, with `residual`, (norm(x + residual), x + residual)."""
    rows, cols = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else out
    r = residual if residual is not None else x
    _add_rms_norm_kernel[(rows,)](
        x, r, weight, out, res_out, x.stride(0), r.stride(0), out.stride(0), res_out.stride(0), cols, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(cols), num_warps=8 if cols >= 2048 else 4,
    )  # fmt: skip
    return out if residual is None else (out, res_out)


@triton.jit
def _store_kv(
    X, KV, Slots, tok, stride_x, plane_stride, slot_stride, heads, d, ok, y1, y2, num_q_heads, num_heads,
    num_kv_heads, HALF: tl.constexpr, KV_PAD: tl.constexpr,
):  # fmt: skip
    """Token `tok`'s rotated K heads (y1/y2 of heads num_q_heads..num_heads) and its V heads (read from
    X after the K heads) into the paged cache KV [2, blocks, block_size, kv_heads, head_dim] at its slot."""
    slot = tl.load(Slots + tok).to(tl.int64)
    k_ok = ok & (heads >= num_q_heads)[:, None]
    k_dst = KV + slot * slot_stride + (heads - num_q_heads)[:, None] * (2 * HALF) + d[None, :]
    # Rounded to the activation dtype first, as the cache write of the unfused path sees it.
    tl.store(k_dst, y1.to(X.dtype.element_ty).to(KV.dtype.element_ty), mask=k_ok)
    tl.store(k_dst + HALF, y2.to(X.dtype.element_ty).to(KV.dtype.element_ty), mask=k_ok)
    v_heads = tl.arange(0, KV_PAD)
    v_ok = (v_heads < num_kv_heads)[:, None] & (d < HALF)[None, :]
    v_src = X + tok * stride_x + (num_heads + v_heads)[:, None] * (2 * HALF) + d[None, :]
    v_dst = KV + plane_stride + slot * slot_stride + v_heads[:, None] * (2 * HALF) + d[None, :]
    tl.store(v_dst, tl.load(v_src, mask=v_ok, other=0.0).to(KV.dtype.element_ty), mask=v_ok)
    tl.store(v_dst + HALF, tl.load(v_src + HALF, mask=v_ok, other=0.0).to(KV.dtype.element_ty), mask=v_ok)


@triton.jit
def _rope_kernel(
    X, Cos, Sin, KV, Slots, stride_x, stride_c, plane_stride, slot_stride, num_q_heads, num_heads, num_kv_heads,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, HEADS_PAD: tl.constexpr, KV_PAD: tl.constexpr,
    WRITE_KV: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, HALF_PAD)
    ok = (heads < num_heads)[:, None] & (d < HALF)[None, :]
    base = X + tok * stride_x + heads[:, None] * (2 * HALF) + d[None, :]
    x1 = tl.load(base, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=ok, other=0.0).to(tl.float32)
    # cos/sin rows are [freqs | freqs] (rotate-half convention): the first half covers both halves.
    c = tl.load(Cos + tok * stride_c + d, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
    s = tl.load(Sin + tok * stride_c + d, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
    y1, y2 = x1 * c - x2 * s, x2 * c + x1 * s
    tl.store(base, y1.to(X.dtype.element_ty), mask=ok)
    tl.store(base + HALF, y2.to(X.dtype.element_ty), mask=ok)
    if WRITE_KV:
        _store_kv(X, KV, Slots, tok, stride_x, plane_stride, slot_stride, heads, d, ok, y1, y2, num_q_heads,
                  num_heads, num_kv_heads, HALF, KV_PAD)


def _cache_args(cache: CacheWrite | None, qkv: torch.Tensor) -> tuple:
    """KV, Slots, plane_stride, slot_stride and WRITE_KV of the kernels (unused placeholders without a cache)."""
    if cache is None:
        return qkv, qkv, 0, 0, False
    kv = cache.kv_cache
    if not kv.is_contiguous():
        raise ValueError("fused RoPE: the KV cache to write must be contiguous")
    return kv, cache.slot_mapping, kv.stride(0), kv.stride(2), True


def rope_(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_q_heads: int, num_kv_heads: int, head_dim: int,
    cache: CacheWrite | None = None,
) -> None:  # fmt: skip
    """Rotate, in place, the q and k heads at the start of each row of `qkv` [T, (q + 2 kv heads) * head_dim],
    and with `cache` write each token's rotated K and its V into the paged cache.

    Q and K heads sit side by side at the start of the fused QKV projection's output, so one
    launch rotates both. cos/sin: [T, head_dim] as from `rotary.rope_cos_sin`.
    """
    half, heads = head_dim // 2, num_q_heads + num_kv_heads
    kv, slots, plane_stride, slot_stride, write = _cache_args(cache, qkv)
    _rope_kernel[(qkv.shape[0],)](
        qkv, cos, sin, kv, slots, qkv.stride(0), cos.stride(0), plane_stride, slot_stride, num_q_heads, heads,
        num_kv_heads, HALF=half, HALF_PAD=triton.next_power_of_2(half), HEADS_PAD=triton.next_power_of_2(heads),
        KV_PAD=triton.next_power_of_2(num_kv_heads), WRITE_KV=write, num_warps=4,
    )  # fmt: skip


@triton.jit
def _qk_norm_rope_kernel(
    X, Cos, Sin, QW, KW, KV, Slots, stride_x, stride_c, plane_stride, slot_stride, num_q_heads, num_heads,
    num_kv_heads, eps, HALF: tl.constexpr, HALF_PAD: tl.constexpr, HEADS_PAD: tl.constexpr, KV_PAD: tl.constexpr,
    WRITE_KV: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, HALF_PAD)
    d_ok = d < HALF
    ok = (heads < num_heads)[:, None] & d_ok[None, :]
    base = X + tok * stride_x + heads[:, None] * (2 * HALF) + d[None, :]
    x1 = tl.load(base, mask=ok, other=0.0)
    x2 = tl.load(base + HALF, mask=ok, other=0.0)
    dtype = x1.dtype
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    # RMSNorm of each head over head_dim, rounded like `RMSNorm.forward`: normalised value to the
    # activation dtype, then times the (query or key) weight, rounded again.
    inv = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
    is_q = (heads < num_q_heads)[:, None]
    w1 = tl.where(is_q, tl.load(QW + d, mask=d_ok, other=0.0)[None, :], tl.load(KW + d, mask=d_ok, other=0.0)[None, :])
    w2 = tl.where(is_q, tl.load(QW + HALF + d, mask=d_ok, other=0.0)[None, :],
                  tl.load(KW + HALF + d, mask=d_ok, other=0.0)[None, :])
    y1 = (w1.to(tl.float32) * (x1 * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    y2 = (w2.to(tl.float32) * (x2 * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    c = tl.load(Cos + tok * stride_c + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    s = tl.load(Sin + tok * stride_c + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    r1, r2 = y1 * c - y2 * s, y2 * c + y1 * s
    tl.store(base, r1.to(dtype), mask=ok)
    tl.store(base + HALF, r2.to(dtype), mask=ok)
    if WRITE_KV:
        _store_kv(X, KV, Slots, tok, stride_x, plane_stride, slot_stride, heads, d, ok, r1, r2, num_q_heads,
                  num_heads, num_kv_heads, HALF, KV_PAD)


def qk_norm_rope_(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_q_heads: int, num_kv_heads: int, head_dim: int,
    q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float, cache: CacheWrite | None = None,
) -> None:  # fmt: skip
    """Qwen3's per-head RMSNorm then RoPE, in place on the q and k heads at the start of each row of `qkv`,
    and with `cache` each token's K and V written into the paged cache (as `rope_`).

    q heads use `q_weight` [head_dim], k heads `k_weight`; cos/sin [T, head_dim] as from `rotary.rope_cos_sin`.
    """
    half = head_dim // 2
    heads = num_q_heads + num_kv_heads
    kv, slots, plane_stride, slot_stride, write = _cache_args(cache, qkv)
    _qk_norm_rope_kernel[(qkv.shape[0],)](
        qkv, cos, sin, q_weight, k_weight, kv, slots, qkv.stride(0), cos.stride(0), plane_stride, slot_stride,
        num_q_heads, heads, num_kv_heads, eps, HALF=half, HALF_PAD=triton.next_power_of_2(half),
        HEADS_PAD=triton.next_power_of_2(heads), KV_PAD=triton.next_power_of_2(num_kv_heads), WRITE_KV=write,
        num_warps=4,
    )  # fmt: skip


@triton.jit
def _silu_mul_kernel(X, Out, stride_x, stride_o, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    gate = tl.load(X + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + n_cols + cols, mask=ok, other=0.0)
    # Rounded like `F.silu(gate) * up`: the activation first, then the product.
    act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
    tl.store(Out + row * stride_o + cols, (act.to(tl.float32) * up.to(tl.float32)).to(Out.dtype.element_ty), mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for `gate_up` = [gate | up] along the last dim."""
    rows, cols2 = gate_up.shape
    cols = cols2 // 2
    out = torch.empty(rows, cols, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(cols, block))](gate_up, out, gate_up.stride(0), out.stride(0), cols,
                                                      BLOCK=block, num_warps=4)
    return out
