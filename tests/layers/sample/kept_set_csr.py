"""The GPU kept set as CSR with the one host read that sizes it: what the tests and the
sampling-mask benchmark compare with the float64 full sort (the sampler itself sizes its CSR
from the shapes, `kept_set_gpu.fill_sampling_mask_dense`)."""

from __future__ import annotations

import torch

from fastdeploy.model_executor.layers.sample import kept_set_gpu


def offsets_of(counts: torch.Tensor) -> torch.Tensor:
    """int32 [R+1] exclusive cumsum of counts, on their device (a total below R * V < 2**31)."""
    offsets = torch.zeros(counts.shape[0] + 1, dtype=torch.int32, device=counts.device)
    torch.cumsum(counts, dim=0, dtype=torch.int32, out=offsets[1:])
    return offsets


def _total_and_flagged(offsets: torch.Tensor, failed: torch.Tensor) -> tuple[int, int]:
    """The one device->host copy of the CSR path: ids to allocate, rows flagged."""
    total, flagged = torch.stack([offsets[-1], failed.sum(dtype=torch.int32)]).tolist()
    return total, flagged


def kept_set_csr(proc, temperature, top_k, top_p, min_p) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Kept sets of truncating, non-greedy rows as CSR on the device: offsets int32 [R+1],
    ids int32 [M] ascending per row, logz float64 [R].

    Two launches, one cumsum and one small device->host copy (sizes the ids).
    """
    b = kept_set_gpu.kept_bounds(proc, temperature, top_k, top_p, min_p)
    offsets = offsets_of(b.count)
    total, flagged = _total_and_flagged(offsets, b.failed)
    if flagged:
        kept_set_gpu.redo_flagged(proc, temperature, top_k, top_p, min_p, b)
        offsets = offsets_of(b.count)
        total = int(offsets[-1])
    return offsets, kept_set_gpu.compact(proc, b, offsets, total), b.logz
