"""Keep a GGUF's Q4_1 projection weights 4-bit on the CPU (layers/quantized_linear.py).

Called after the dense weights are loaded: every fused projection whose GGUF parts are all
Q4_1 is replaced by an `Int4Linear` built from the file's raw blocks, so the weight the
model multiplies by is the file's, not a requantisation. Everything else stays as loaded,
and one log line says which tensors stay dequantized and why.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import cast

import gguf
import numpy as np
import torch
from torch import nn

from fastdeploy.common.config import ModelConfig
from fastdeploy.distributed.parallel_state import tp_size
from fastdeploy.model_executor.layers.quantized_linear import Int4Linear
from fastdeploy.model_executor.model_loader.gguf_loader import reverse_permute
from fastdeploy.model_executor.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

# Fused projection (under model.layers.N.) -> its GGUF tensors (under blk.N.), in row order.
_PROJECTIONS = {
    "self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "self_attn.o_proj": ("attn_output",),
    "mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
    "mlp.down_proj": ("ffn_down",),
}
_Q4_1_BLOCK_BYTES = 20  # float16 d, float16 m, 16 bytes of two 4-bit codes each


def q4_1_blocks(tensor: gguf.ReaderTensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q4_1 tensor's codes uint8 [rows, cols] and per-group d, m float32 [rows, cols / 32].

    ggml's block: d, m, then qs[16] where element j is qs[j] & 15 and element j + 16 is qs[j] >> 4.
    """
    rows = int(tensor.shape[1])
    blocks = np.asarray(tensor.data, dtype=np.uint8).reshape(rows, -1, _Q4_1_BLOCK_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., 4:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, -1)
    return codes, d, m


def _q4_1_rows(tensor: gguf.ReaderTensor, config: ModelConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Like q4_1_blocks, with llama's Q/K rows put back in HF order (as gguf_loader does for dense weights)."""
    codes, d, m = q4_1_blocks(tensor)
    kind = tensor.name.split(".")[2]
    if config.architecture == "llama" and kind in ("attn_q", "attn_k"):
        heads = config.num_attention_heads if kind == "attn_q" else config.num_key_value_heads
        codes, d, m = (reverse_permute(a, heads) for a in (codes, d, m))
    return codes, d, m


def keep_gguf_quantized(net: LlamaForCausalLM, reader: gguf.GGUFReader, config: ModelConfig) -> list[str]:
    """Swap every all-Q4_1 projection of `net` for an Int4Linear; returns the swapped module names."""
    tensors = {t.name: t for t in reader.tensors}
    swapped: list[str] = []
    dense: dict[str, list[str]] = defaultdict(list)  # reason -> GGUF tensors left dequantized
    for i in range(config.num_hidden_layers):
        for module_name, parts in _PROJECTIONS.items():
            names = [f"blk.{i}.{p}.weight" for p in parts]
            kinds = {tensors[n].tensor_type.name for n in names}
            if tp_size() > 1:
                dense["tensor parallelism shards the dense weights"] += names
                continue
            if kinds <= {"F32", "F16", "BF16"}:
                dense["not quantized in the file"] += names
                continue
            if kinds != {"Q4_1"}:
                dense[f"{'/'.join(sorted(kinds))}: no exact weight-only matmul in PyTorch"] += names
                continue
            full_name = f"model.layers.{i}.{module_name}"
            linear = cast(nn.Linear, net.get_submodule(full_name))
            if linear.in_features % 32:
                dense["input size not a multiple of 32"] += names
                continue
            codes, d, m = (np.concatenate(a) for a in zip(*(_q4_1_rows(tensors[n], config) for n in names),
                                                           strict=True))
            bias = None if linear.bias is None else linear.bias.detach()
            quantized = Int4Linear.from_q4_1(torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(m), bias)
            parent, _, child = full_name.rpartition(".")
            setattr(net.get_submodule(parent), child, quantized)
            swapped.append(full_name)
    projection_tensors = {f"blk.{i}.{p}.weight" for i in range(config.num_hidden_layers)
                          for parts in _PROJECTIONS.values() for p in parts}  # fmt: skip
    for name, tensor in tensors.items():
        kind = tensor.tensor_type.name
        if name.endswith(".weight") and name not in projection_tensors and kind not in ("F32", "F16", "BF16"):
            # Q8_0 has a scale per 32 weights; PyTorch's int8 weight-only matmul has one per row.
            dense[f"{kind} outside the projections (embedding, LM head): no exact weight-only matmul in "
                  "PyTorch, dequantized to the model's dtype"].append(name)
    logger.info("GGUF on CPU: %d projections kept 4-bit (Q4_1, bfloat16 activations)", len(swapped))
    for reason, names in dense.items():
        logger.info("GGUF on CPU: %d tensors stay dequantized (%s): %s", len(names), reason,
                    ", ".join(names[:6]) + (", ..." if len(names) > 6 else ""))
    return swapped
