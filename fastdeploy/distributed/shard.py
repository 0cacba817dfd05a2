"""How a Llama-family model splits across tensor-parallel ranks (Megatron-style).

Column-parallel (output rows split): q/k/v by heads, gate/up by MLP channels (each expert's too).
Row-parallel (input columns split, outputs summed): o_proj, down_proj (each expert's too).
Vocabulary-parallel: embedding rows and LM head rows, the vocabulary padded to a
multiple of the size. Norms are replicated.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from fastdeploy.common.config import ModelConfig

_COLUMN = (".q_proj.", ".k_proj.", ".v_proj.", ".gate_proj.", ".up_proj.")
_ROW = (".o_proj.", ".down_proj.")
_VOCAB = ("embed_tokens.", "lm_head.")


def check_divisible(config: ModelConfig, size: int) -> None:
    sizes = {name: getattr(config, name) for name in ("num_attention_heads", "num_key_value_heads",
                                                      "intermediate_size")}
    if config.moe is not None:
        sizes["moe_intermediate_size"] = config.moe.moe_intermediate_size
    for name, value in sizes.items():
        if value % size:
            raise ValueError(f"--tensor-parallel-size {size} does not divide {name}={value}")


def local_config(config: ModelConfig, size: int) -> ModelConfig:
    """The per-rank shapes: heads and MLP channels (dense and each expert's) divided by `size`."""
    if size == 1:
        return config
    check_divisible(config, size)
    moe = config.moe and replace(config.moe, moe_intermediate_size=config.moe.moe_intermediate_size // size)
    return replace(config, num_attention_heads=config.num_attention_heads // size,
                   num_key_value_heads=config.num_key_value_heads // size,
                   intermediate_size=config.intermediate_size // size, moe=moe)


def vocab_shard(vocab_size: int, rank: int, size: int) -> tuple[int, int]:
    """[start, end) of the rank's vocabulary rows; every rank holds ceil(V / size) rows (zero padded)."""
    per_rank = -(-vocab_size // size)
    return rank * per_rank, (rank + 1) * per_rank


def shard_weight(name: str, tensor: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This rank's slice of an HF-named full tensor."""
    if size == 1:
        return tensor
    if any(frag in name for frag in _COLUMN):
        return tensor.chunk(size, dim=0)[rank]
    if any(frag in name for frag in _ROW) and name.endswith(".weight"):
        return tensor.chunk(size, dim=1)[rank]
    if any(name.startswith(frag) or f".{frag}" in name for frag in _VOCAB):
        start, end = vocab_shard(tensor.shape[0], rank, size)
        part = tensor[start:min(end, tensor.shape[0])]
        if part.shape[0] < end - start:
            part = torch.cat([part, part.new_zeros(end - start - part.shape[0], *part.shape[1:])])
        return part
    return tensor
