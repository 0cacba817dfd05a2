"""FP8 block-wise checkpoints (`quantization_config.quant_method == "fp8"`, as the Qwen3 FP8 releases ship).

Each quantized linear weight W [out, in] is stored as float8 e4m3 with a float32
`weight_scale_inv` [ceil(out / bh), ceil(in / bw)] for blocks of `weight_block_size` [bh, bw]:
W = W_fp8 * scale_inv of its block. The engine dequantizes each weight as it is read, into the
tensor its model parameter is built from; the forward pass then runs in the model's dtype
(bf16 on CUDA), so FP8 checkpoints load and run, with the memory of a bf16 checkpoint and
no FP8 GEMM. Activation quantization (`activation_scheme: dynamic`) is therefore not
applied.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

SCALE_SUFFIX = "_scale_inv"


def dequantize_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float32 W [out, in] from the e4m3 `weight` and its per-block `scale_inv` [ceil(out/bh), ceil(in/bw)]."""
    rows, cols = weight.shape
    bh, bw = block
    if scale_inv.shape != (-(-rows // bh), -(-cols // bw)):
        raise ValueError(f"FP8 weight of shape {tuple(weight.shape)} with blocks {block} needs scales of shape "
                         f"{(-(-rows // bh), -(-cols // bw))}, got {tuple(scale_inv.shape)}")
    scale = scale_inv.float().repeat_interleave(bh, dim=0)[:rows].repeat_interleave(bw, dim=1)[:, :cols]
    return weight.float() * scale


def dequantize_fp8_weights(
    weights: Iterable[tuple[str, torch.Tensor]], block: tuple[int, int]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with every FP8 weight dequantized (and its scale consumed).

    A weight and its scale may come in either order (and from different shards): whichever
    arrives first waits for the other. Tensors that are not FP8 pass through unchanged.
    """
    pending_weights: dict[str, torch.Tensor] = {}
    pending_scales: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if name.endswith(SCALE_SUFFIX):
            weight_name = name[: -len(SCALE_SUFFIX)]
            if weight_name in pending_weights:
                yield weight_name, dequantize_block_fp8(pending_weights.pop(weight_name), tensor, block)
            else:
                pending_scales[weight_name] = tensor
        elif tensor.dtype == torch.float8_e4m3fn:
            if name in pending_scales:
                yield name, dequantize_block_fp8(tensor, pending_scales.pop(name), block)
            else:
                pending_weights[name] = tensor
        else:
            yield name, tensor
    if pending_weights or pending_scales:
        raise ValueError(f"FP8 checkpoint: weights without scales {sorted(pending_weights)[:4]}, "
                         f"scales without weights {sorted(pending_scales)[:4]}")
