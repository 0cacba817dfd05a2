"""RMSNorm, computed in float32 like the HF reference so low-precision runs stay stable."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalise `x`; with `residual`, first add it and also return the sum.

        The fused add keeps the decoder loop to one residual stream (nano-vllm style).
        """
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        # Same op order as HF: cast back first, then scale by the weight.
        out = self.weight * h.to(dtype)
        return out if residual is None else (out, residual)
