"""The Triton kept-set backend (CUDA): sort-free kept sets as a dense mask (`kept_set_gpu`).

Without ``settle``, a row the kernel could not settle keeps a superset and is reported by
`DenseKeptSets.unsettled`, with no host read spent on finding out; the sampler marks its token
`UNSETTLED_TOKEN`. The sampling mask is compacted on the device into a buffer sized from the
shapes and the host's top_k, so that path reads nothing back either.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fastdeploy.model_executor.layers.sample import kept_set_gpu
from fastdeploy.model_executor.layers.sample.kept_set import GREEDY_SLOT, PLAIN_SLOT, KeptSets, NoiseFn
from fastdeploy.model_executor.layers.sample.metadata import SamplerOutput, SamplingMetadata
from fastdeploy.model_executor.layers.sample.ops import apply_temperature

NEG_INF = float("-inf")


@dataclass
class DenseKeptSets:
    """Kept sets of T rows as the kernel left them; ``x`` (float32 [T, V], proc / temperature)
    is set by `draw`."""

    kept: kept_set_gpu.GpuKeptSet
    proc: torch.Tensor  # float32 [T, V]
    temperature: torch.Tensor  # [T]
    settled: bool  # every set redone exactly where the kernel flagged it
    x: torch.Tensor | None = None

    def draw(self, noise: NoiseFn) -> torch.Tensor:
        self.x = apply_temperature(self.proc, self.temperature)  # float32 [T, V]
        scores = (self.x + noise(None)).masked_fill_(~self.kept.mask, NEG_INF)
        return scores.argmax(dim=1)

    def write_processed_logits(self, final: torch.Tensor, rows: torch.Tensor) -> None:
        assert self.x is not None, "draw first"
        final[rows] = self.x.masked_fill(~self.kept.mask, NEG_INF)

    def unsettled(self) -> torch.Tensor | None:
        failed = self.kept.bounds.failed
        return None if self.settled or failed is None else failed != 0


class TritonKeptSetBackend:
    """`KeptSetBackend` on CUDA with Triton."""

    leaves_unsettled = True

    def kept_sets(
        self,
        proc: torch.Tensor,
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        min_p: torch.Tensor,
        settle: bool,
        want_logz: torch.Tensor | None,
    ) -> DenseKeptSets:
        kept = kept_set_gpu.kept_set(proc, temperature, top_k, top_p, min_p, settle)
        return DenseKeptSets(kept, proc, temperature, settle)

    def fill_sampling_mask(
        self,
        out: SamplerOutput,
        proc: torch.Tensor,
        meta: SamplingMetadata,
        requested: torch.Tensor,
        groups: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        kept: KeptSets | None,
        as_bits: torch.Tensor | None,
    ) -> None:
        assert kept is None or isinstance(kept, DenseKeptSets)
        g_rows, t_rows, p_rows = groups
        b, v = proc.shape
        slots = _mask_slots(meta, b, g_rows, t_rows)
        guided = meta.token_bitmask is not None
        capacity = _mask_capacity(meta, v, t_rows.numel()) + g_rows.numel() + (p_rows.numel() * v if guided else 0)
        dense = kept.kept if kept is not None else None
        kept_set_gpu.fill_sampling_mask_dense(out, proc, requested, slots, capacity, dense, bitmap_rows=as_bits,
                                              guided=guided)


def _mask_slots(meta: SamplingMetadata, b: int, g_rows: torch.Tensor, t_rows: torch.Tensor) -> torch.Tensor:
    """int32 [B] row slots for the CUDA mask kernel (see `RowGroups.mask_slots`): the host's
    where given, else scattered on the device."""
    if meta.row_groups is not None and meta.row_groups.mask_slots is not None:
        return meta.row_groups.mask_slots
    slots = torch.full((b,), PLAIN_SLOT, dtype=torch.int32, device=t_rows.device)
    slots[g_rows] = GREEDY_SLOT
    slots[t_rows] = torch.arange(t_rows.numel(), dtype=torch.int32, device=t_rows.device)
    return slots


def _mask_capacity(meta: SamplingMetadata, v: int, num_truncated: int) -> int:
    """The most ids the truncating rows' kept sets can hold: top_k where the host gave it
    (a kept set never exceeds it), else the whole vocabulary per row."""
    top_k = meta.row_groups.truncated_top_k if meta.row_groups is not None else None
    if top_k is None:
        return num_truncated * v
    return int(np.where(top_k > 0, np.minimum(top_k, v), v).sum())
