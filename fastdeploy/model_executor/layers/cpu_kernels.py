"""The CPU kernels of custom_ops/ (GGUF block matmuls, fused decode ops) as torch.ops.fastdeploy_cpu.*.

Built by `pip install -e .` (setup.py), else compiled on first use. The fused decode ops run
only outside autograd (they have no backward): training code paths keep the PyTorch ops.
"""

from __future__ import annotations

import functools

import torch

from fastdeploy.common.extensions import load_extension


@functools.cache
def cpu_ops():
    """torch.ops.fastdeploy_cpu, loaded (or built) once."""
    load_extension("_cpu_kernels")
    return torch.ops.fastdeploy_cpu


def fused_cpu(x: torch.Tensor) -> bool:
    """Whether the fused CPU decode ops take `x`'s layer: float32 on the CPU, no gradient wanted."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and not torch.is_grad_enabled()
