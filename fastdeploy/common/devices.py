"""Facts about a device that do not change while the process runs."""

from __future__ import annotations

import functools

import torch


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 for CPU tensors (Triton's interpreter)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count
