"""One Triton kernel for the end of a row-parallel sub-block: the wait for the peers, the sum over
ranks of their partial products (read from every rank's symmetric-memory buffer over NVLink), the
residual add and the RMSNorm that follows, as `add_rms_norm` computes them after an all-reduce.

The wait is in the kernel, taken by one program: program 0 signals every rank's program 0
through the signal pads and waits for theirs (a flag per sending rank, set with release and
taken with acquire semantics at system scope), then raises a flag in local memory that the
other programs wait on. A peer's kernel starts only after that peer's product is complete
(stream order), so a signal received means the peer's slot can be read. Meanwhile the other
programs load their residual row and the norm weight; a separate barrier kernel before this
one is not needed. The last program past the wait lowers the flag again, so every call (and
every CUDA-graph replay) starts from zero. Programs are dispatched in index order, so program
0 runs whatever the grid: the others only wait for it.

Every rank sums the partials in rank order, so all ranks get the same bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _handshake(Pads, pad_base, rank, WORLD: tl.constexpr):
    """Program 0 of every rank meets here: each signals all ranks, then takes every rank's signal."""
    for peer in tl.static_range(WORLD):
        pad = tl.load(Pads + peer).to(tl.pointer_type(tl.int32))
        # A flag still up is the previous call's, not yet taken by that peer: wait for it.
        while tl.atomic_cas(pad + pad_base + rank, 0, 1, sem="release", scope="sys") != 0:
            pass
    own = tl.load(Pads + rank).to(tl.pointer_type(tl.int32))
    for peer in tl.static_range(WORLD):
        while tl.atomic_cas(own + pad_base + peer, 1, 0, sem="acquire", scope="sys") != 1:
            pass


@triton.jit
def _sum_add_rms_norm_kernel(
    Buffers, Pads, pad_base, rank, Ready, Passed, offset, R, W, Out, ResOut, n_cols, eps,
    WORLD: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    program = tl.program_id(0)
    row = program.to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    # Local reads first: they overlap the wait.
    r = tl.load(R + row * n_cols + cols, mask=ok, other=0.0)
    w = tl.load(W + cols, mask=ok, other=0.0)
    if program == 0:
        _handshake(Pads, pad_base, rank, WORLD)
        tl.atomic_xchg(Ready, 1, sem="release", scope="gpu")
    while tl.load(Ready, volatile=True) == 0:
        pass
    # Acquire: the peers' slots are read after this. The last program past lowers the flag.
    if tl.atomic_add(Passed, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        tl.atomic_xchg(Passed, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(Ready, 0, sem="relaxed", scope="gpu")
    at = offset + row * n_cols + cols
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for rank_read in tl.static_range(WORLD):
        # An address read from memory carries no alignment; the buffers' is known (16-byte
        # loads, not one element at a time).
        buffer = tl.multiple_of(tl.load(Buffers + rank_read).to(tl.pointer_type(Out.dtype.element_ty)), 16)
        # Past L1 (".cg"): another GPU wrote this memory since the last kernel that read it.
        total += tl.load(buffer + at, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
    # Rounded as the all-reduce's output and the residual add's are on the unfused path.
    summed = total.to(Out.dtype.element_ty)
    x = (summed.to(tl.float32) + r.to(tl.float32)).to(Out.dtype.element_ty)
    tl.store(ResOut + row * n_cols + cols, x, mask=ok)
    h = x.to(tl.float32)
    var = tl.sum(h * h, 0) / n_cols
    y = (h * tl.rsqrt(var + eps)).to(Out.dtype.element_ty)
    tl.store(Out + row * n_cols + cols, (w.to(tl.float32) * y.to(tl.float32)).to(Out.dtype.element_ty), mask=ok)


def sum_add_rms_norm(buffers: torch.Tensor, pads: torch.Tensor, pad_base: int, rank: int, flags: torch.Tensor,
                     offset: int, shape: tuple[int, int], residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(sum + residual), sum + residual), where sum adds the [rows, cols] partials that every
    rank holds at element `offset` of its buffer. `buffers` / `pads`: the ranks' buffer and
    signal-pad addresses (int64); `pad_base`: the first of the world-size int32 flags this kernel
    uses in each pad; `flags`: two int32 zeros in this rank's memory (the local wait's flag and
    count), back at zero after each call."""
    rows, cols = shape
    assert residual.shape == shape and residual.is_contiguous(), "the residual stream is [rows, hidden]"
    out = torch.empty_like(residual)
    res_out = torch.empty_like(residual)
    _sum_add_rms_norm_kernel[(rows,)](
        buffers, pads, pad_base, rank, flags[0:], flags[1:], offset, residual, weight, out, res_out, cols, eps,
        WORLD=buffers.numel(), BLOCK=triton.next_power_of_2(cols), num_warps=8 if cols >= 2048 else 4,
    )  # fmt: skip
    return out, res_out
