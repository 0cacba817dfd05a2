"""A step's results in slot layout (B sequences x S slots) and their gather into a frame.

Speculative decoding verifies S = draft tokens + 1 slots per sequence and accepts
the first `accept_counts[b]` of them; without speculation S = 1. The worker holds
the step's results in this fixed layout; `gather_step_slots` picks the accepted
slots out as the `StepFrame` of `step_frame.py`. Packed, that frame defines what the
custom ops (`fastdeploy.ops.step_packer`) must produce, byte for byte.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from torch import Tensor

from fastdeploy.common.step_frame import StepFrame


@dataclass
class StepSlots:
    message_id: int
    seq_ids: Tensor  # int64 [B]
    accept_counts: Tensor  # int32 [B], each in 0..S
    token_ids: Tensor  # int64 [B, S]; slots >= accept_counts[b] hold garbage
    num_logprobs: int  # k = largest top_logprobs requested in the step; -1 = no logprobs in this step
    lp_ids: Tensor | None = None  # int64 [B, S, K+1] with K >= k; column 0 = the slot's token, 1..K top-K
    lp_values: Tensor | None = None  # float32 [B, S, K+1]
    ranks: Tensor | None = None  # int64 [B, S]
    mask_offsets: Tensor | None = None  # int32 [B*S + 1], CSR over mask_ids, row b*S+s; empty row = null
    mask_ids: Tensor | None = None  # int32 [>= M]: ids past mask_offsets[-1] are never read
    logz: Tensor | None = None  # float32 [B, S]
    # uint8 [B, S, ceil(V/8)]: bitmaps of the rows that asked for them (their CSR rows are empty).
    # Not part of the packed frame: it travels beside it (`StepOutput.mask_bits`).
    mask_bits: Tensor | None = None

    @property
    def has_logprobs(self) -> bool:
        return self.num_logprobs >= 0

    @property
    def has_mask(self) -> bool:
        return self.mask_offsets is not None


def _numpy(t: Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


def accepted_rows(accept_counts: np.ndarray, num_slots: int) -> np.ndarray:
    """Flat slot rows (b * S + s, s < accept_counts[b]) in sequence order."""
    counts = accept_counts.astype(np.int64)
    if counts.size and (counts.min() < 0 or counts.max() > num_slots):
        raise ValueError(f"accept_counts must lie in 0..{num_slots}")
    starts = np.repeat(np.arange(len(counts), dtype=np.int64) * num_slots, counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    return starts + np.arange(int(counts.sum()), dtype=np.int64) - first


def gather_step_slots(slots: StepSlots) -> StepFrame:
    """The accepted slots as a StepFrame: what the packed frame of this step holds."""
    token_ids = _numpy(slots.token_ids)
    batch, num_slots = token_ids.shape
    counts = _numpy(slots.accept_counts).astype(np.int32)
    rows = accepted_rows(counts, num_slots)
    frame = StepFrame(
        message_id=slots.message_id,
        seq_ids=_numpy(slots.seq_ids).astype(np.int64),
        num_tokens=counts,
        token_ids=token_ids.reshape(batch * num_slots)[rows],
    )
    if slots.has_logprobs:
        if slots.lp_ids is None or slots.lp_values is None or slots.ranks is None:
            raise ValueError("num_logprobs >= 0 needs lp_ids, lp_values and ranks")
        width = slots.num_logprobs + 1
        if slots.lp_ids.shape[2] < width:
            columns = slots.lp_ids.shape[2] - 1
            raise ValueError(f"lp_ids has {columns} top-k columns, fewer than k = {slots.num_logprobs}")
        lp_shape = (batch * num_slots, slots.lp_ids.shape[2])
        frame.lp_ids = _numpy(slots.lp_ids).reshape(lp_shape)[rows, :width]
        frame.lp_values = _numpy(slots.lp_values).reshape(lp_shape)[rows, :width]
        frame.ranks = _numpy(slots.ranks).reshape(batch * num_slots)[rows]
    if slots.mask_offsets is not None:
        if slots.mask_ids is None or slots.logz is None:
            raise ValueError("mask_offsets needs mask_ids and logz")
        offsets = _numpy(slots.mask_offsets).astype(np.int64)
        starts, ends = offsets[rows], offsets[rows + 1]
        lengths = ends - starts
        frame.mask_offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        # Flat source index of every kept id: its row's start plus its place in the row.
        within = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(frame.mask_offsets[:-1], lengths)
        frame.mask_ids = _numpy(slots.mask_ids)[np.repeat(starts, lengths) + within]
        frame.logz = _numpy(slots.logz).reshape(batch * num_slots)[rows]
    return frame

