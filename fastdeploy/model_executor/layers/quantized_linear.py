"""A linear layer whose weight stays in a GGUF file's own blocks on the CPU (Q4_1 or Q8_0).

The kernel (`custom_ops/gguf_matmul_cpu.cpp`) multiplies by each weight's float32 value as
gguf dequantizes it (Q4_1: `w = q * d + m`, Q8_0: `w = q * d`, d and m float16) with float32
activations and accumulators, so the result is the dense float32 matmul on the dequantized
weight up to the order of the sums. A decode step then reads 5 (Q4_1) or 8.5 (Q8_0) bits per
weight instead of 32; that read is most of a small model's CPU decode step.
"""

from __future__ import annotations

import gguf
import torch
from torch import nn

from fastdeploy.model_executor.layers.cpu_kernels import cpu_ops

GROUP_SIZE = 32
# Bytes of one GGUF block of 32 weights by ggml type: Q4_1 (float16 d, m, 16 bytes of codes), Q8_0 (d, 32 int8).
GGUF_BLOCK_BYTES = {3: 20, 8: 34}


class GGUFLinear(nn.Module):
    """`y = x @ w.t() + bias` for `w` [out, in] held as a GGUF file's Q4_1 or Q8_0 blocks (CPU only)."""

    def __init__(
        self, blocks: torch.Tensor, ggml_type: int, in_features: int, bias: torch.Tensor | None = None
    ) -> None:
        """`blocks`: uint8 [out, in / 32 * block bytes], the file's rows; `ggml_type`: 3 (Q4_1) or 8 (Q8_0)."""
        super().__init__()
        if ggml_type not in GGUF_BLOCK_BYTES:
            raise ValueError(f"GGUF linear: ggml type {ggml_type} is not 3 (Q4_1) or 8 (Q8_0)")
        if in_features % GROUP_SIZE or blocks.shape[1] != in_features // GROUP_SIZE * GGUF_BLOCK_BYTES[ggml_type]:
            raise ValueError(f"GGUF linear: blocks {tuple(blocks.shape)} do not hold rows of {in_features} weights")
        self.in_features, self.out_features, self.ggml_type = in_features, blocks.shape[0], ggml_type
        self.register_buffer("blocks", blocks.contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.clone(), requires_grad=False)

    def dequantized(self) -> torch.Tensor:
        """float32 [out, in]: the weight the kernel multiplies by (gguf's own dequantization)."""
        return cpu_ops().gguf_dequantize(self.blocks, self.ggml_type, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()
        y = cpu_ops().gguf_matmul(rows, self.blocks, self.ggml_type)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        kind = gguf.GGMLQuantizationType(self.ggml_type).name
        return f"in_features={self.in_features}, out_features={self.out_features}, {kind}"
