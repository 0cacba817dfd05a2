"""A linear layer whose weight stays 4-bit on the CPU: PyTorch's int4 weight-only matmul.

The weight is stored as unsigned 4-bit codes `q` in groups of 32 along the input dimension,
each group with a scale `s` and zero `z`: `w = (q - 8) * s + z`. llama.cpp's Q4_1 blocks
(`w = q * d + m`) are this with `s = d`, `z = m + 8d`, so a Q4_1 GGUF tensor maps onto it
without requantising. Each decode step then reads 4.5 bits per weight instead of 32.

The kernel (`_weight_int4pack_mm_for_cpu`) is fast only with bfloat16 activations (with
float32 ones it is slower than the dense float32 matmul), so the input is rounded to
bfloat16, the group scales and zeros are bfloat16, and the output is cast back to the
input's dtype: the rest of the model (norms, attention, KV cache, residual stream) keeps
its own dtype.
"""

from __future__ import annotations

import torch
from torch import nn

GROUP_SIZE = 32
COMPUTE_DTYPE = torch.bfloat16


class Int4Linear(nn.Module):
    """`y = x @ w.t() + bias` for `w` [out, in] held as packed 4-bit groups of 32 (CPU only)."""

    def __init__(
        self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bias: torch.Tensor | None = None
    ) -> None:
        """`codes`: uint8 [out, in] in 0..15; `scales`, `zeros`: float [out, in / 32]; `bias`: [out] or None."""
        super().__init__()
        out_features, in_features = codes.shape
        if in_features % GROUP_SIZE or scales.shape != (out_features, in_features // GROUP_SIZE):
            raise ValueError(f"int4 linear: codes {tuple(codes.shape)} and scales {tuple(scales.shape)} do not make "
                             f"groups of {GROUP_SIZE} along the input dimension")
        self.in_features, self.out_features = in_features, out_features
        # The kernel's layout: innerKTiles=1 packs two codes a byte, [out, in / 2].
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1))
        # [in / 32, out, 2]: per group, (scale, zero) of every output row.
        self.register_buffer("scales_and_zeros",
                             torch.stack([scales.t(), zeros.t()], dim=-1).to(COMPUTE_DTYPE).contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.clone(), requires_grad=False)

    @classmethod
    def from_q4_1(
        cls, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bias: torch.Tensor | None = None
    ) -> Int4Linear:
        """From llama.cpp Q4_1 blocks (`w = q * d + m` per group of 32): scale d, zero m + 8d."""
        d, m = d.float(), m.float()
        return cls(codes, d, m + 8 * d, bias)

    def dequantized(self) -> torch.Tensor:
        """float32 [out, in]: the weight the kernel multiplies by (scales and zeros rounded to bfloat16)."""
        eye = torch.eye(self.in_features, dtype=COMPUTE_DTYPE)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, GROUP_SIZE,
                                                          self.scales_and_zeros).float().t().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(COMPUTE_DTYPE)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, GROUP_SIZE, self.scales_and_zeros)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={GROUP_SIZE}, int4"
