"""The sampler's rows as the packer's [B sequences, S slots] layout, with the accept counts
of speculative verification decided on the device."""

from __future__ import annotations

import itertools

import numpy as np
import torch

from fastdeploy.common.step_slots import StepSlots
from fastdeploy.model_executor.device_inputs import upload_int64
from fastdeploy.model_executor.layers.sample.metadata import SamplerOutput
from fastdeploy.worker.verify_kernels import VerifiedSlots, verify_rows


def step_slots(message_id: int, seq_ids: list[int], slot_drafts: list[list[int]], out: SamplerOutput,
               drafted: torch.Tensor | None = None, verified: VerifiedSlots | None = None) -> StepSlots:
    """The sampler's rows (each sequence's verified slots, one after another) as the [B, S] slot
    layout the packer op reads, with the accept counts decided on the device: a sequence keeps
    its drafts up to the first one its own sample disagrees with, plus that sample. Slots a
    sequence did not verify are padding and never accepted. `drafted`: the drafts on the
    device (see `verify`), where the host has only their number; `verified`: `verify` of these
    rows, where the step already found its accept counts (at launch)."""
    sampled = out.sampled_token_ids
    device = sampled.device
    logprobs, mask = _logprob_parts(out), _mask_parts(out)
    batch = len(seq_ids)
    width = 1 + max(len(d) for d in slot_drafts)
    if width == 1:  # no drafts: row b is slot (b, 0), every slot is accepted
        seq_ids_d, = upload_int64([seq_ids], device)
        slots = StepSlots(message_id=message_id, seq_ids=seq_ids_d,
                          accept_counts=torch.ones(batch, dtype=torch.int32, device=device),
                          token_ids=sampled.view(batch, 1),
                          num_logprobs=-1 if out.logprobs is None else out.logprobs.shape[1] - 1)
        if logprobs is not None:
            lp_ids, lp_values, ranks = logprobs
            slots.lp_ids, slots.lp_values = lp_ids.unsqueeze(1), lp_values.unsqueeze(1)
            slots.ranks = ranks.view(batch, 1)
        if mask is not None:
            mask_offsets, mask_ids, logz = mask
            slots.mask_offsets, slots.mask_ids, slots.logz = mask_offsets, mask_ids, logz.view(batch, 1)
        if out.mask_bits is not None:
            slots.mask_bits = out.mask_bits.view(batch, 1, -1)
        return slots
    seq_ids_d, = upload_int64([seq_ids], device)
    if verified is None:
        verified = verify(slot_drafts, sampled, drafted)
    rows, valid = verified.rows, verified.valid
    slots = StepSlots(
        message_id=message_id,
        seq_ids=seq_ids_d,
        accept_counts=verified.accepted,
        token_ids=verified.tokens,
        num_logprobs=-1 if out.logprobs is None else out.logprobs.shape[1] - 1,
    )
    if logprobs is not None:
        lp_ids, lp_values, ranks = logprobs
        slots.lp_ids, slots.lp_values, slots.ranks = lp_ids[rows], lp_values[rows], ranks[rows]
    if mask is not None:
        mask_offsets, mask_ids, logz = mask
        # Padding slots get empty CSR rows; real rows keep their order, so mask_ids stay as they are.
        lengths = (mask_offsets[1:] - mask_offsets[:-1])[rows].masked_fill(~valid, 0)
        offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=device)
        offsets[1:] = lengths.flatten().cumsum(0)
        slots.mask_offsets, slots.mask_ids, slots.logz = offsets, mask_ids, logz[rows]
    if out.mask_bits is not None:
        slots.mask_bits = out.mask_bits[rows]  # padding slots are never accepted, so never read
    return slots


def verify(slot_drafts: list[list[int]], sampled: torch.Tensor, drafted: torch.Tensor | None = None
           ) -> VerifiedSlots:
    """A verify step's sampler rows (`sampled`, each sequence's slots one after another) as
    [B, S] slots with each sequence's accept count, found on the device. `drafted`: int64
    [B, >= S - 1] drafts already on the device (-1 past a sequence's own; drafts made ahead),
    in place of the values of `slot_drafts`, of which only the lengths are read then."""
    width = max(len(d) for d in slot_drafts)
    widths = [len(d) for d in slot_drafts]
    starts = list(itertools.accumulate((w + 1 for w in widths), initial=0))[:-1]
    if drafted is None:
        host_drafted = np.full((len(slot_drafts), width), -1, dtype=np.int64)  # -1 never equals a sampled token
        for b, draft in enumerate(slot_drafts):
            host_drafted[b, :len(draft)] = draft
        starts_d, widths_d, drafted = upload_int64([starts, widths, host_drafted], sampled.device)
        drafted = drafted.view(len(slot_drafts), width)
    else:
        starts_d, widths_d = upload_int64([starts, widths], sampled.device)
    return verify_rows(sampled, starts_d, widths_d, drafted, width)


def _logprob_parts(out: SamplerOutput) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(top ids, logprobs, ranks): the sampler returns all three or none."""
    if out.logprobs is None:
        return None
    assert out.logprob_token_ids is not None and out.sampled_token_ranks is not None
    return out.logprob_token_ids, out.logprobs, out.sampled_token_ranks


def _mask_parts(out: SamplerOutput) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(CSR offsets, ids, logZ) of the kept sets: the sampler returns all three or none."""
    if out.mask_offsets is None:
        return None
    assert out.mask_ids is not None and out.logz is not None
    return out.mask_offsets, out.mask_ids, out.logz
