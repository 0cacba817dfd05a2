"""What the sampler needs to know about each row of a step's logits."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class RowGroups:
    """The batch's rows split by how they draw, decided on the host from the request parameters
    so the sampler needs no `nonzero()` (a host-device synchronisation on CUDA) to find them.

    Each is an int64 index tensor on the logits' device, ascending; together they cover every
    row once.
    """

    greedy: torch.Tensor  # temperature <= 0
    truncated: torch.Tensor  # not greedy, and top_k > 0, top_p < 1 or min_p > 0
    plain: torch.Tensor  # neither: a draw over the whole vocabulary
    host: tuple[list[int], list[int], list[int]]  # the same three, as host lists
    # int32 [B]: each row's index in `truncated`, GREEDY_SLOT if greedy, PLAIN_SLOT if plain (`kept_set`). The
    # CUDA sampling-mask kernel reads it; None when no row wants a mask.
    mask_slots: torch.Tensor | None = None
    # int64 [T] on the host: the truncating rows' top_k (0 = off). A row keeps at most top_k
    # ids, which bounds the CUDA mask buffer below rows x vocabulary. None when no row wants a mask.
    truncated_top_k: np.ndarray | None = None


@dataclass
class SamplingMetadata:
    """Per-row sampling parameters for a batch of B rows, as tensors on the logits' device."""

    temperature: torch.Tensor  # float32 [B]; 0 means greedy
    top_k: torch.Tensor  # int64 [B]; 0 means off
    top_p: torch.Tensor  # float32 [B]; 1.0 means off
    min_p: torch.Tensor  # float32 [B]; 0.0 means off
    repetition_penalty: torch.Tensor  # float32 [B]; 1.0 means off
    presence_penalty: torch.Tensor  # float32 [B]; 0.0 means off
    frequency_penalty: torch.Tensor  # float32 [B]; 0.0 means off
    # Token history for penalties, right-padded with -1; None when no row has a penalty.
    prompt_token_ids: torch.Tensor | None  # int64 [B, P]
    output_token_ids: torch.Tensor | None  # int64 [B, O]
    # Sparse logit bias as COO triples; None when no row has one.
    logit_bias_rows: torch.Tensor | None  # int64 [M]
    logit_bias_cols: torch.Tensor | None  # int64 [M]
    logit_bias_values: torch.Tensor | None  # float32 [M]
    # A generator per row for requests with a seed; None rows use the default generator.
    generators: list[torch.Generator | None]
    # Largest top_logprobs requested in the step; -1 when no row wants logprobs.
    max_num_logprobs: int
    logprobs_mode: str  # "raw_logprobs" | "processed_logprobs"
    # Rows whose kept set (sampling mask) is wanted; None when no row wants it.
    return_sampling_mask: torch.Tensor | None  # bool [B]
    # bool [B]: rows (a subset of return_sampling_mask's) whose kept sets go out as bitmaps.
    mask_bitmap_rows: torch.Tensor | None = None
    # Optional guided-decoding bitmask: int32 [B, ceil(V / 32)], bit set = allowed.
    token_bitmask: torch.Tensor | None = None
    # Row split known on the host; None makes the sampler derive it on the device.
    row_groups: RowGroups | None = None


@dataclass
class SamplerOutput:
    """What one sampler call produced for B rows."""

    sampled_token_ids: torch.Tensor  # int64 [B]
    # Column 0 is the sampled token, columns 1..k the top-k; None when max_num_logprobs < 0.
    logprob_token_ids: torch.Tensor | None  # int64 [B, k + 1]
    logprobs: torch.Tensor | None  # float32 [B, k + 1]
    sampled_token_ranks: torch.Tensor | None  # int64 [B]; 1 = most likely token
    # Kept sets as CSR; row r's ids are mask_ids[mask_offsets[r]:mask_offsets[r + 1]].
    # An empty row means null: no truncation, or no mask requested for that row.
    mask_offsets: torch.Tensor | None  # int32 [B + 1]
    # int32 [>= mask_offsets[-1]], sorted ascending within each row. On CUDA it is a buffer
    # sized without reading the offsets back; what lies past mask_offsets[-1] is unspecified.
    mask_ids: torch.Tensor | None
    logz: torch.Tensor | None  # float32 [B]; 0.0 for null rows
    # uint8 [B, ceil(V/8)]: the kept sets of the rows that asked for bitmaps (bit i % 8 of byte
    # i // 8, LSB first; all zero for a null row), whose CSR rows are left empty; zeros for the
    # other rows. None when no row asked for bitmaps.
    mask_bits: torch.Tensor | None = None
