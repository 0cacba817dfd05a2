"""The bookkeeping of a verify step sent ahead, one kernel launch each on CUDA.

A step launched before its predecessor's frame places that step's tokens (and drafts) into its
own inputs on the device, and after sampling finds each sequence's accept count there. As
tensor operations these are about fifty small launches a step, and at a small model's step
(about a millisecond) their host cost is the step's largest part; on CUDA each is one Triton
program grid instead. The tensor versions stay as the reference and run on other devices.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from fastdeploy.spec_decode.ngram_device import NO_DRAFT, slot_block
from fastdeploy.spec_decode.verification import accept_counts

try:  # pragma: no cover - only on machines with triton
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

_BLOCK = 128
_NO_DRAFT = tl.constexpr(NO_DRAFT) if triton is not None else NO_DRAFT  # what a kernel may read of it


@dataclass
class PlacedRows:
    """Where a step's in-flight rows come from (int64 device tensors, one upload): each row's
    index in the step (`flat`), the predecessor's sampler row it continues (`source`) and its
    offset in that sequence's run (0: the newest token, j: draft j); per sampled sequence of
    the step, its predecessor's row and the drafts it verifies."""

    flat: torch.Tensor
    source: torch.Tensor
    offset: torch.Tensor
    sampler_rows: torch.Tensor
    sampler_widths: torch.Tensor


def place_rows(rows: PlacedRows, tokens: torch.Tensor, drafts: torch.Tensor | None, advance: torch.Tensor | None,
               input_ids: torch.Tensor, positions: torch.Tensor, context_lens: torch.Tensor,
               block_tables: torch.Tensor, slot_mapping: torch.Tensor, block_size: int, width: int
               ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Writes each in-flight row's token id (`tokens[source]`, or draft `offset` - 1 of `drafts`)
    into `input_ids`; with `advance`, moves the row's position, context length and cache slot on
    by its source's `advance`. Returns (the drafts each sampled sequence verifies, int64 [B,
    width], NO_DRAFT past its own; the real drafts among them per sequence, int64 [B]), both
    None when `width` is 0."""
    if triton is not None and tokens.is_cuda:
        return _place_triton(rows, tokens, drafts, advance, input_ids, positions, context_lens, block_tables,
                             slot_mapping, block_size, width)
    return _place_torch(rows, tokens, drafts, advance, input_ids, positions, context_lens, block_tables,
                        slot_mapping, block_size, width)


def _place_torch(rows: PlacedRows, tokens: torch.Tensor, drafts: torch.Tensor | None, advance: torch.Tensor | None,
                 input_ids: torch.Tensor, positions: torch.Tensor, context_lens: torch.Tensor,
                 block_tables: torch.Tensor, slot_mapping: torch.Tensor, block_size: int, width: int
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    flat, source = rows.flat, rows.source
    row_tokens = tokens[source]
    drafted = proposed = None
    if width:
        assert drafts is not None
        cols = (rows.offset - 1).clamp(min=0, max=drafts.shape[1] - 1)
        row_tokens = torch.where(rows.offset > 0, drafts[source, cols], row_tokens)
        taken = torch.arange(width, device=tokens.device) < rows.sampler_widths.unsqueeze(1)
        drafted = torch.where(taken, drafts[rows.sampler_rows, :width], NO_DRAFT)
        proposed = (drafted != NO_DRAFT).sum(1)
    # A row the kept-set kernel left unsettled holds a negative marker until it is redrawn (and
    # the step run again); clamped so the embedding never reads outside the table.
    input_ids[flat] = row_tokens.clamp(min=0)
    if advance is not None:
        row_advance = advance[source]
        moved = positions[flat] + row_advance
        positions[flat] = moved
        context_lens[flat] += row_advance
        tables = block_tables[flat]
        slot_mapping[flat] = tables.gather(1, (moved // block_size).unsqueeze(1)).squeeze(1) * block_size \
            + moved % block_size
    return drafted, proposed


def _place_triton(rows: PlacedRows, tokens: torch.Tensor, drafts: torch.Tensor | None, advance: torch.Tensor | None,
                  input_ids: torch.Tensor, positions: torch.Tensor, context_lens: torch.Tensor,
                  block_tables: torch.Tensor, slot_mapping: torch.Tensor, block_size: int, width: int
                  ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    num_rows, batch = rows.flat.shape[0], rows.sampler_rows.shape[0]
    drafted = proposed = None
    if width:
        assert drafts is not None
        drafted = torch.empty(batch, width, dtype=torch.long, device=tokens.device)
        proposed = torch.empty(batch, dtype=torch.long, device=tokens.device)
    grid = (triton.cdiv(max(num_rows, batch if width else 0, 1), _BLOCK),)
    # Unused pointers get a tensor of the right kind; the flags keep them unread.
    _place_kernel[grid](
        rows.flat, rows.source, rows.offset, rows.sampler_rows, rows.sampler_widths, num_rows, batch,
        tokens, drafts if drafts is not None else tokens, 0 if drafts is None else drafts.stride(0),
        0 if drafts is None else drafts.shape[1], advance if advance is not None else tokens, int(advance is not None),
        input_ids, positions, context_lens, block_tables, block_tables.stride(0), slot_mapping, block_size,
        drafted if drafted is not None else tokens, proposed if proposed is not None else tokens, width,
        WIDTH_P2=slot_block(width), BLOCK=_BLOCK)
    return drafted, proposed


@dataclass
class VerifiedSlots:
    """A verify step's sampler rows as [B, S] slots, on the device: each slot's sampler row
    (clamped), whether it is real, the token sampled there, each sequence's accept count, its
    newest token (the last accepted) and the positions it moved on past its first row's next
    (accepted - 1)."""

    rows: torch.Tensor  # int64 [B, S]
    valid: torch.Tensor  # bool [B, S]
    tokens: torch.Tensor  # int64 [B, S]
    accepted: torch.Tensor  # int32 [B]
    newest: torch.Tensor  # int64 [B]
    advance: torch.Tensor  # int64 [B]


def verify_rows(sampled: torch.Tensor, starts: torch.Tensor, widths: torch.Tensor, drafted: torch.Tensor,
                width: int) -> VerifiedSlots:
    """The sampler's rows (`sampled`, int64: sequence b's 1 + widths[b] slots from row
    starts[b]) as [B, width + 1] slots, with each sequence's accept count: its drafts
    (`drafted`, int64 [B, >= width]) up to the first its own sample disagrees with, plus that
    sample."""
    if triton is not None and sampled.is_cuda:
        return _verify_triton(sampled, starts, widths, drafted, width)
    return _verify_torch(sampled, starts, widths, drafted, width)


def _verify_torch(sampled: torch.Tensor, starts: torch.Tensor, widths: torch.Tensor, drafted: torch.Tensor,
                  width: int) -> VerifiedSlots:
    device = sampled.device
    slot = torch.arange(width + 1, device=device)
    valid = slot <= widths.unsqueeze(1)
    rows = torch.where(valid, starts.unsqueeze(1) + slot, 0)
    tokens = sampled[rows]
    accepted = accept_counts(tokens, torch.where(slot[:-1] < widths.unsqueeze(1), drafted[:, :width], NO_DRAFT))
    advance = accepted.long() - 1
    newest = tokens.gather(1, advance.unsqueeze(1)).squeeze(1)
    return VerifiedSlots(rows, valid, tokens, accepted, newest, advance)


def _verify_triton(sampled: torch.Tensor, starts: torch.Tensor, widths: torch.Tensor, drafted: torch.Tensor,
                   width: int) -> VerifiedSlots:
    batch, device = widths.shape[0], sampled.device
    rows = torch.empty(batch, width + 1, dtype=torch.long, device=device)
    valid = torch.empty(batch, width + 1, dtype=torch.bool, device=device)
    tokens = torch.empty(batch, width + 1, dtype=torch.long, device=device)
    accepted = torch.empty(batch, dtype=torch.int32, device=device)
    newest = torch.empty(batch, dtype=torch.long, device=device)
    advance = torch.empty(batch, dtype=torch.long, device=device)
    if batch:
        _verify_kernel[(batch,)](sampled, starts, widths, drafted, drafted.stride(0), rows, valid, tokens, accepted,
                                 newest, advance, width + 1, S_P2=slot_block(width + 1))
    return VerifiedSlots(rows, valid, tokens, accepted, newest, advance)


def warm_up(device: torch.device) -> None:
    """Runs each kernel once on a tiny step (the variants a step can take: with and without a
    predecessor's advance), so that none compiles while a step waits on it."""
    long = functools.partial(torch.zeros, dtype=torch.long, device=device)
    rows = PlacedRows(long(2), long(2), torch.tensor([0, 1], device=device), long(1), torch.ones(1, dtype=torch.long,
                                                                                              device=device))
    for advance in (None, long(1)):
        place_rows(rows, long(1), long(1, 1), advance, long(2), long(2), long(2), long(2, 1), long(2), 16, 1)
    verify_rows(long(2), long(1), torch.ones(1, dtype=torch.long, device=device), long(1, 1), 1)


# Sizes and strides change from step to step; specialising on them would compile again.
_VARYING = {"do_not_specialize": ["num_rows", "batch", "drafts_stride", "drafts_cols", "has_advance", "table_stride",
                                  "block_size", "width"]}


if triton is not None:

    @triton.jit(**_VARYING)
    def _place_kernel(Flat, Source, Offset, SamplerRows, SamplerWidths, num_rows, batch,
                      Tokens, Drafts, drafts_stride, drafts_cols, Advance, has_advance,
                      InputIds, Positions, ContextLens, Tables, table_stride, SlotMapping, block_size,
                      Drafted, Proposed, width, WIDTH_P2: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        live = i < num_rows
        flat = tl.load(Flat + i, mask=live, other=0)
        source = tl.load(Source + i, mask=live, other=0)
        token = tl.load(Tokens + source, mask=live, other=0)
        if width > 0:
            offset = tl.load(Offset + i, mask=live, other=0)
            col = tl.minimum(tl.maximum(offset - 1, 0), drafts_cols - 1)
            draft = tl.load(Drafts + source * drafts_stride + col, mask=live & (offset > 0), other=0)
            token = tl.where(offset > 0, draft, token)
        tl.store(InputIds + flat, tl.maximum(token, 0), mask=live)
        if has_advance != 0:
            advance = tl.load(Advance + source, mask=live, other=0)
            moved = tl.load(Positions + flat, mask=live, other=0) + advance
            tl.store(Positions + flat, moved, mask=live)
            tl.store(ContextLens + flat, tl.load(ContextLens + flat, mask=live, other=0) + advance, mask=live)
            block = tl.load(Tables + flat * table_stride + moved // block_size, mask=live, other=0)
            tl.store(SlotMapping + flat, block * block_size + moved % block_size, mask=live)
        if width > 0:
            b = i
            seq = b < batch
            row = tl.load(SamplerRows + b, mask=seq, other=0)
            own = tl.load(SamplerWidths + b, mask=seq, other=0)
            k = tl.arange(0, WIDTH_P2)
            cell = seq[:, None] & (k[None, :] < width)
            taken = cell & (k[None, :] < own[:, None])
            draft = tl.load(Drafts + row[:, None] * drafts_stride + k[None, :], mask=taken, other=_NO_DRAFT)
            tl.store(Drafted + b[:, None] * width + k[None, :], draft, mask=cell)
            tl.store(Proposed + b, tl.sum((draft != _NO_DRAFT).to(tl.int64), 1), mask=seq)

    @triton.jit(do_not_specialize=["drafted_stride", "S"])
    def _verify_kernel(Sampled, Starts, Widths, Drafted, drafted_stride, Rows, Valid, Tokens, Accepted, Newest,
                       Advance, S, S_P2: tl.constexpr):  # fmt: skip
        b = tl.program_id(0).to(tl.int64)
        start = tl.load(Starts + b)
        own = tl.load(Widths + b)
        s = tl.arange(0, S_P2)
        valid = s <= own
        rows = tl.where(valid, start + s, 0)
        token = tl.load(Sampled + rows, mask=s < S, other=0)
        draft = tl.load(Drafted + b * drafted_stride + s, mask=s < own, other=_NO_DRAFT)
        # The accept count: 1 + the drafts before the first disagreement (a slot past the own
        # drafts disagrees).
        disagree = (s < S - 1) & ((s >= own) | (token != draft))
        first = tl.min(tl.where(disagree, s, S - 1), 0)
        accepted = first + 1
        tl.store(Rows + b * S + s, rows, mask=s < S)
        tl.store(Valid + b * S + s, valid, mask=s < S)
        tl.store(Tokens + b * S + s, token, mask=s < S)
        tl.store(Accepted + b, accepted.to(tl.int32))
        tl.store(Newest + b, tl.sum(tl.where(s == first, token, 0), 0))
        tl.store(Advance + b, first.to(tl.int64))
