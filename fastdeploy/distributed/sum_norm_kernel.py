"""One Triton kernel for the end of a row-parallel sub-block: the sum over ranks of their partial
products (read from every rank's symmetric-memory buffer over NVLink), the residual add and the
RMSNorm that follows, as `add_rms_norm` computes them after an all-reduce.

Every rank sums the partials in rank order, so all ranks get the same bits. The caller has
run a barrier first: every rank's product is complete in its buffer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _sum_add_rms_norm_kernel(
    Buffers, offset, R, W, Out, ResOut, n_cols, eps, WORLD: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    at = offset + row * n_cols + cols
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for rank in tl.static_range(WORLD):
        # An address read from memory carries no alignment; the buffers' is known (16-byte
        # loads, not one element at a time).
        buffer = tl.multiple_of(tl.load(Buffers + rank).to(tl.pointer_type(Out.dtype.element_ty)), 16)
        # Past L1 (".cg"): another GPU wrote this memory since the last kernel that read it.
        total += tl.load(buffer + at, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
    # Rounded as the all-reduce's output and the residual add's are on the unfused path.
    summed = total.to(Out.dtype.element_ty)
    x = (summed.to(tl.float32) + tl.load(R + row * n_cols + cols, mask=ok, other=0.0).to(tl.float32))
    x = x.to(Out.dtype.element_ty)
    tl.store(ResOut + row * n_cols + cols, x, mask=ok)
    h = x.to(tl.float32)
    var = tl.sum(h * h, 0) / n_cols
    y = (h * tl.rsqrt(var + eps)).to(Out.dtype.element_ty)
    w = tl.load(W + cols, mask=ok, other=0.0)
    tl.store(Out + row * n_cols + cols, (w.to(tl.float32) * y.to(tl.float32)).to(Out.dtype.element_ty), mask=ok)


def sum_add_rms_norm(buffers: torch.Tensor, offset: int, shape: tuple[int, int], residual: torch.Tensor,
                     weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(sum + residual), sum + residual), where sum adds the [rows, cols] partials that every
    rank holds at element `offset` of its buffer; `buffers`: the ranks' buffer addresses (int64)."""
    rows, cols = shape
    assert residual.shape == shape and residual.is_contiguous(), "the residual stream is [rows, hidden]"
    out = torch.empty_like(residual)
    res_out = torch.empty_like(residual)
    _sum_add_rms_norm_kernel[(rows,)](
        buffers, offset, residual, weight, out, res_out, cols, eps, WORLD=buffers.numel(),
        BLOCK=triton.next_power_of_2(cols), num_warps=8 if cols >= 2048 else 4,
    )  # fmt: skip
    return out, res_out
