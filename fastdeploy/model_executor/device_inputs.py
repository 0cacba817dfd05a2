"""Moving a step's host-built arrays to the device in one copy that never waits for the GPU."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

# Every array starts on a 16-byte boundary: each byte slice can be viewed as its dtype, and a
# Triton kernel given one sees the same pointer alignment whatever the sizes of the arrays before
# it (Triton specialises on 16-byte alignment, so a changing one would compile the kernel again).
_ALIGN = 16


def upload(arrays: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Device tensors (flat views of one buffer), one per array, each keeping its dtype.

    On CUDA the bytes go through pinned memory with a non-blocking copy: one transfer for the
    lot, and the host does not wait for the GPU's queued work (a `torch.tensor(list,
    device="cuda")` does). The pinned buffer comes from PyTorch's caching host allocator, which
    does not hand it out again before the copy has completed.
    """
    parts = [np.ascontiguousarray(a).reshape(-1) for a in arrays]
    offsets = []
    size = 0
    for part in parts:
        offsets.append(size)
        size += -(-part.nbytes // _ALIGN) * _ALIGN
    host = torch.empty(size, dtype=torch.uint8, pin_memory=device.type == "cuda")
    raw = host.numpy()
    for part, start in zip(parts, offsets, strict=True):
        raw[start:start + part.nbytes] = part.view(np.uint8)
    flat = host.to(device, non_blocking=True) if device.type == "cuda" else host
    return [flat[start:start + part.nbytes].view(torch.from_numpy(part[:0]).dtype)
            for part, start in zip(parts, offsets, strict=True)]


def upload_int64(arrays: Sequence[Sequence[int] | np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """int64 device tensors (views of one buffer), one per input array, in order."""
    return upload([np.asarray(a, dtype=np.int64) for a in arrays], device)
