"""Keep a GGUF's quantized weights in the file's blocks on the CPU (layers/quantized_linear.py).

Called after the dense weights are loaded: every fused projection whose GGUF parts share one
of the kernel's types (Q4_1, Q8_0), and the LM head, is replaced by a `GGUFLinear` holding the
file's raw blocks (rows concatenated in the fused order, llama's Q/K rows put back in HF
order), so the weight the model multiplies by is the file's, not a requantisation. Everything
else stays as loaded (the embedding lookup keeps its dense rows), and one log line says which
tensors stay dequantized and why.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import cast

import numpy as np
import torch
from torch import nn

from fastdeploy.common.config import ModelConfig
from fastdeploy.distributed.parallel_state import tp_size
from fastdeploy.model_executor.layers.quantized_linear import GGUFLinear
from fastdeploy.model_executor.model_loader.gguf_file import GGUFFile, GGUFTensor
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
def _raw_rows(tensor: GGUFTensor, config: ModelConfig) -> np.ndarray:
    """A quantized tensor's blocks as uint8 [rows, bytes a row], llama's Q/K rows put back in HF order."""
    rows = int(tensor.shape[1])
    blocks = np.asarray(tensor.data, dtype=np.uint8).reshape(rows, -1)
    kind = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else ""
    if config.architecture == "llama" and kind in ("attn_q", "attn_k"):
        blocks = reverse_permute(blocks, config.num_attention_heads if kind == "attn_q" else config.num_key_value_heads)
    return blocks


def _gguf_linear(tensors: list[GGUFTensor], config: ModelConfig, bias: torch.Tensor | None) -> GGUFLinear:
    rows = np.concatenate([_raw_rows(t, config) for t in tensors])
    return GGUFLinear(torch.from_numpy(np.ascontiguousarray(rows)), int(tensors[0].tensor_type),
                      int(tensors[0].shape[0]), bias)


def keep_gguf_quantized(net: LlamaForCausalLM, file: GGUFFile, config: ModelConfig) -> list[str]:
    """Swap every projection of `net` whose GGUF parts share one of the kernel's types (Q4_1, Q8_0),
    and the LM head, for GGUFLinear; returns the swapped module names."""
    tensors = {t.name: t for t in file.tensors}
    supported = {"Q4_1", "Q8_0"}
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
            if len(kinds) != 1 or not kinds <= supported:
                dense[f"{'/'.join(sorted(kinds))}: no CPU kernel for this type"] += names
                continue
            full_name = f"model.layers.{i}.{module_name}"
            linear = cast(nn.Linear, net.get_submodule(full_name))
            if linear.in_features % 32:
                dense["input size not a multiple of 32"] += names
                continue
            bias = None if linear.bias is None else linear.bias.detach()
            quantized = _gguf_linear([tensors[n] for n in names], config, bias)
            parent, _, child = full_name.rpartition(".")
            setattr(net.get_submodule(parent), child, quantized)
            swapped.append(full_name)
    head = tensors.get("output.weight", tensors["token_embd.weight"])
    if tp_size() == 1 and head.tensor_type.name in supported:
        # The embedding lookup keeps its dense rows; the LM head, read whole every step, stays in blocks.
        net.lm_head = _gguf_linear([head], config, None)
        swapped.append("lm_head")
    elif head.tensor_type.name not in ("F32", "F16", "BF16"):
        dense[f"{head.tensor_type.name} LM head: dequantized to the model's dtype"].append(head.name)
    logger.info("GGUF on CPU: %d linears kept in the file's blocks", len(swapped))
    for reason, names in dense.items():
        logger.info("GGUF on CPU: %d tensors stay dequantized (%s): %s", len(names), reason,
                    ", ".join(names[:6]) + (", ..." if len(names) > 6 else ""))
    return swapped
