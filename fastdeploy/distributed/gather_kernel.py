"""One Triton kernel that lays every rank's [rows, cols] shard side by side into [rows, ranks * cols],
reading the peers' shards from their symmetric-memory buffers over NVLink (the vocabulary-parallel
logits, on the rank that samples). The caller has run a barrier first: every shard is complete."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gather_columns_kernel(Buffers, offset, Out, cols, WORLD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    at = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = at < cols
    for rank in tl.static_range(WORLD):
        # An address read from memory carries no alignment; the buffers' is known (16-byte loads).
        shard = tl.multiple_of(tl.load(Buffers + rank).to(tl.pointer_type(Out.dtype.element_ty)), 16)
        # Past L1 (".cg"): another GPU wrote this memory since the last kernel that read it.
        values = tl.load(shard + offset + row * cols + at, mask=ok, cache_modifier=".cg")
        tl.store(Out + row * (WORLD * cols) + rank * cols + at, values, mask=ok)


def gather_columns(buffers: torch.Tensor, offset: int, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """[rows, ranks * cols]: rank r's [rows, cols] shard (at element `offset` of its buffer, whose
    address is `buffers[r]`) in columns r * cols onwards."""
    rows, cols = shape
    world = buffers.numel()
    out = torch.empty(rows, world * cols, dtype=dtype, device=buffers.device)
    block = 2048
    _gather_columns_kernel[(rows, triton.cdiv(cols, block))](buffers, offset, out, cols, WORLD=world, BLOCK=block)
    return out
