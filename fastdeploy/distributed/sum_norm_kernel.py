"""One Triton kernel for the end of a row-parallel sub-block: the exchange of the ranks' partial
products over NVLink, their sum, the residual add and the RMSNorm that follows, as `add_rms_norm`
computes them after an all-reduce.

No barrier: every rank writes its partial into each peer's inbox (posted writes, which do not wait
for a reply), and the data is its own ready flag. An inbox holds a sentinel bit pattern (-0.0 for
16-bit floats) until the peer's values land, so a reader spins on its local inbox until no element
holds the sentinel, then writes the sentinel back for the next message. A partial element equal
to the sentinel is sent as a zero of the same sign class (+0.0 for 16-bit floats; for float32 the
one denormal 0x80008000 as -0.0) and every rank applies the same rule to its own partial, so all
ranks sum the same values, in rank order, and get the same bits.

An inbox row is rewritten only after something that waits for every rank went between: the
other slot's exchange (the two slots alternate, attention then MLP), an all-reduce, or the barrier
the caller adds when one slot comes twice in a row. A reader resets its row in the kernel that
read it, which finishes before it reaches that wait: the reset always lands first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastdeploy.common.devices import multiprocessors

# A rank that waits this long for a peer's partial stops the device (a trap) instead of hanging:
# the peer died or left the step sequence the ranks share.
WAIT_LIMIT_NS = 30_000_000_000

# Per element size (bits): the integer type the kernel moves elements as, the sentinel an empty
# inbox element holds (every 16-bit half 0x8000), and what a partial equal to it is sent as.
_SENTINELS = {16: (tl.int16, -0x8000, 0), 32: (tl.int32, -0x7FFF8000, -0x80000000)}
INBOX_FILL_INT16 = -0x8000  # an empty inbox, written as int16 for any element size


@triton.jit
def _globaltimer():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _trap():
    tl.inline_asm_elementwise("trap; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _exchange_sum_add_rms_norm_kernel(
    Buffers, inbox, region, rank, R, W, Out, ResOut, rows, n_cols, eps, wait_limit_ns,
    WORLD: tl.constexpr, INT: tl.constexpr, SENTINEL: tl.constexpr, SENT_AS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    first = tl.program_id(0)
    stride = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    # An address read from memory carries no alignment; the buffers' is known (16-byte accesses).
    mine = tl.multiple_of(tl.load(Buffers + rank).to(tl.pointer_type(INT)), 16)
    own = inbox + rank * region  # this rank's partial: its own region of its inbox
    # 1. Send every row of this program before waiting for any: a peer's program waits only on
    # rows whose sender already ran this loop (the grid never exceeds what is resident at once).
    for row in range(first, rows, stride):
        at = tl.cast(row, tl.int64) * n_cols + cols
        bits = tl.load(mine + own + at, mask=ok)
        bits = tl.where(bits == SENTINEL, SENT_AS, bits)
        for peer in tl.static_range(WORLD):
            if peer != rank:
                there = tl.multiple_of(tl.load(Buffers + peer).to(tl.pointer_type(INT)), 16)
                tl.store(there + own + at, bits, mask=ok)
    # 2. Receive, sum in rank order, add the residual, normalise.
    for row in range(first, rows, stride):
        at = tl.cast(row, tl.int64) * n_cols + cols
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for sender in tl.static_range(WORLD):
            where = mine + inbox + sender * region + at
            if sender == rank:
                bits = tl.load(where, mask=ok)
                bits = tl.where(bits == SENTINEL, SENT_AS, bits)
            else:
                # Volatile: past L1, since the peer writes this memory while the loop reads it.
                bits = tl.load(where, mask=ok, other=0, volatile=True)
                empty = tl.sum(((bits == SENTINEL) & ok).to(tl.int32), 0)
                if empty > 0:
                    deadline = _globaltimer() + wait_limit_ns
                    while empty > 0:
                        bits = tl.load(where, mask=ok, other=0, volatile=True)
                        empty = tl.sum(((bits == SENTINEL) & ok).to(tl.int32), 0)
                        if _globaltimer() > deadline:
                            _trap()
                tl.store(where, tl.full([BLOCK], SENTINEL, INT), mask=ok)  # empty for the next message
            total += bits.to(Out.dtype.element_ty, bitcast=True).to(tl.float32)
        # Rounded as the all-reduce's output and the residual add's are on the unfused path.
        summed = total.to(Out.dtype.element_ty)
        x = summed.to(tl.float32) + tl.load(R + at, mask=ok, other=0.0).to(tl.float32)
        x = x.to(Out.dtype.element_ty)
        tl.store(ResOut + at, x, mask=ok)
        h = x.to(tl.float32)
        var = tl.sum(h * h, 0) / n_cols
        y = (h * tl.rsqrt(var + eps)).to(Out.dtype.element_ty)
        w = tl.load(W + cols, mask=ok, other=0.0)
        tl.store(Out + at, (w.to(tl.float32) * y.to(tl.float32)).to(Out.dtype.element_ty), mask=ok)


def exchange_sum_add_rms_norm(buffers: torch.Tensor, rank: int, inbox: int, region: int, shape: tuple[int, int],
                              residual: torch.Tensor, weight: torch.Tensor, eps: float
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(sum + residual), sum + residual), where sum adds the ranks' [rows, cols] partials.
    Rank r's partial sits at element `inbox + r * region` of its own buffer and is written to the
    same place in every peer's; `buffers`: the ranks' buffer addresses (int64). Every rank must
    call this with the same shape and slot, in the same order."""
    rows, cols = shape
    assert residual.shape == shape and residual.is_contiguous(), "the residual stream is [rows, hidden]"
    integer, sentinel, sent_as = _SENTINELS[residual.element_size() * 8]
    out = torch.empty_like(residual)
    res_out = torch.empty_like(residual)
    # One program per multiprocessor at most: every program surely runs at once.
    grid = (max(1, min(rows, multiprocessors(residual.device))),)
    _exchange_sum_add_rms_norm_kernel[grid](
        buffers, inbox, region, rank, residual, weight, out, res_out, rows, cols, eps, WAIT_LIMIT_NS,
        WORLD=buffers.numel(), INT=integer, SENTINEL=sentinel, SENT_AS=sent_as,
        BLOCK=triton.next_power_of_2(cols), num_warps=8 if cols >= 2048 else 4,
    )  # fmt: skip
    return out, res_out
