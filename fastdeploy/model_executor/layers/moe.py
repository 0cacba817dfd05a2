"""Qwen3-MoE's sparse MLP: a softmax router picks the top-k experts of each token, each expert is a
SiLU-gated MLP, and the token's output is the router-weighted sum of its experts' outputs.

Experts are stacked: `w13_weight` [E, 2I, H] (each expert's gate rows, then its up rows) and
`w2_weight` [E, H, I]. On CPU `moe_reference` loops over the experts (the specification); on
CUDA `fused_moe.fused_moe` sorts the (token, expert) pairs by expert and runs grouped Triton
GEMMs with no host sync, so decode steps replay in CUDA graphs. Under tensor parallelism each
rank holds every expert's share of the intermediate dim (gate/up column-parallel, down
row-parallel, like the dense MLP) and the partial outputs are summed by one all-reduce.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fastdeploy.common.config import ModelConfig
from fastdeploy.distributed.parallel_state import all_reduce, tp_size

_EXPERT_NAME = re.compile(r"^(?P<module>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)"
                          r"\.weight$")


@dataclass(frozen=True)
class ExpertSlot:
    """Where one HF per-expert matrix (`...mlp.experts.E.gate_proj.weight`) goes."""

    module: str  # the MoEExperts module, e.g. "model.layers.3.mlp.experts"
    expert: int
    proj: str  # gate_proj | up_proj | down_proj


def expert_weight_slot(name: str) -> ExpertSlot | None:
    m = _EXPERT_NAME.match(name)
    return None if m is None else ExpertSlot(m["module"], int(m["expert"]), m["proj"])


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k experts of each row of `router_logits` [T, E] and their weights.

    Softmax in float32 over all experts, then the k largest probabilities, renormalised to sum
    to 1 when `renormalize` (Qwen3-MoE's `norm_topk_prob`); weights are returned in the logits'
    dtype [T, k], expert ids int64 [T, k] (largest first), as transformers computes them.
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


def moe_reference(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]) for each row t of `x` [T, H]: [T, H].

    One expert at a time over the rows routed to it, summed into the output in expert order.
    """
    num_experts, top_k = w13.shape[0], topk_ids.shape[1]
    out = torch.zeros_like(x)
    flat_ids = topk_ids.reshape(-1)
    flat_weights = topk_weights.reshape(-1, 1)
    order = torch.argsort(flat_ids, stable=True)  # (token, slot) pairs grouped by expert
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start : start + count]
        start += count
        tokens = pairs // top_k
        gate, up = F.linear(x[tokens], w13[expert]).chunk(2, dim=-1)
        h = F.linear(F.silu(gate) * up, w2[expert]) * flat_weights[pairs]
        out.index_add_(0, tokens, h.to(out.dtype))
    return out


class MoEExperts(nn.Module):
    """The stacked experts of one sparse layer (this rank's share of their intermediate dim)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def load_expert(self, expert: int, proj: str, tensor: torch.Tensor) -> str:
        """Copy one HF matrix (already this rank's shard) into its slice; returns the parameter's name."""
        i = self.intermediate_size
        name, dst = {
            "gate_proj": ("w13_weight", self.w13_weight.data[expert, :i]),
            "up_proj": ("w13_weight", self.w13_weight.data[expert, i:]),
            "down_proj": ("w2_weight", self.w2_weight.data[expert]),
        }[proj]
        if dst.shape != tensor.shape:
            raise ValueError(f"expert {expert} {proj}: expected shape {tuple(dst.shape)}, got {tuple(tensor.shape)}")
        dst.copy_(tensor)
        return name

    def shards_of(self, param_name: str) -> int:
        """HF matrices that make up a parameter: gate and up of every expert, or down of every expert."""
        return self.num_experts * (2 if param_name.endswith("w13_weight") else 1)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from fastdeploy.model_executor.layers import fused_moe  # triton is optional on CPU hosts

            return fused_moe.fused_moe(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids)
        return moe_reference(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids)


class SparseMoeBlock(nn.Module):
    """Router (`gate`, replicated on every rank) + experts; HF names `mlp.gate.weight`, `mlp.experts.E.*`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        moe = config.moe
        assert moe is not None, "a sparse MoE block needs config.moe"
        self.top_k = moe.num_experts_per_tok
        self.renormalize = moe.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, moe.num_experts, bias=False)
        self.experts = MoEExperts(moe.num_experts, config.hidden_size, moe.moe_intermediate_size // tp_size())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        if logits.is_cuda:
            from fastdeploy.model_executor.layers import fused_moe

            topk_weights, topk_ids = fused_moe.fused_topk(logits, self.top_k, self.renormalize)
        else:
            topk_weights, topk_ids = route(logits, self.top_k, self.renormalize)
        return all_reduce(self.experts(x, topk_weights, topk_ids))
