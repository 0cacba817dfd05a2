"""The sampler's rows as the packer's [B sequences, S slots] layout, with the accept counts
of speculative verification decided on the device."""

from __future__ import annotations

import itertools

import numpy as np
import torch

from fastdeploy.common.step_slots import StepSlots
from fastdeploy.model_executor.device_inputs import upload_int64
from fastdeploy.model_executor.layers.sample.metadata import SamplerOutput
from fastdeploy.spec_decode.verification import accept_counts


def step_slots(message_id: int, seq_ids: list[int], slot_drafts: list[list[int]], out: SamplerOutput) -> StepSlots:
    """The sampler's rows (each sequence's verified slots, one after another) as the [B, S] slot
    layout the packer op reads, with the accept counts decided on the device: a sequence keeps
    its drafts up to the first one its own sample disagrees with, plus that sample. Slots a
    sequence did not verify are padding and never accepted."""
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
    starts = list(itertools.accumulate((len(d) + 1 for d in slot_drafts), initial=0))[:-1]
    index = np.full((batch, width), -1, dtype=np.int64)
    drafted = np.full((batch, width - 1), -1, dtype=np.int64)  # -1 never equals a sampled token
    for b, (start, draft) in enumerate(zip(starts, slot_drafts, strict=True)):
        index[b, :len(draft) + 1] = np.arange(start, start + len(draft) + 1)
        drafted[b, :len(draft)] = draft
    seq_ids_d, index_d, drafted_d = upload_int64([seq_ids, index, drafted], device)
    index_d, drafted_d = index_d.view(batch, width), drafted_d.view(batch, width - 1)
    valid = index_d >= 0
    rows = index_d.clamp(min=0)
    tokens = sampled[rows]
    slots = StepSlots(
        message_id=message_id,
        seq_ids=seq_ids_d,
        accept_counts=accept_counts(tokens, drafted_d),
        token_ids=tokens,
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
