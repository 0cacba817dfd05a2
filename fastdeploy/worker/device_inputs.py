"""Moving a step's integer inputs to the device in one copy."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def upload_int64(arrays: Sequence[Sequence[int] | np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """int64 device tensors (views of one buffer), one per input array, in order.

    On CUDA the buffer goes through pinned memory with a non-blocking copy: one transfer per step
    instead of one per array, and none of them waits for the GPU to finish queued work.
    """
    parts = [np.asarray(a, dtype=np.int64).reshape(-1) for a in arrays]
    flat = torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, np.int64))
    if device.type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    else:
        flat = flat.to(device)
    return list(flat.split([p.size for p in parts]))
