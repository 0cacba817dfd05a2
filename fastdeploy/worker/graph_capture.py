"""The largest decode batch a step can hold, and the CUDA graphs captured for it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastdeploy.common.config import EngineConfig
from fastdeploy.model_executor.cuda_graph import CudaGraphRunner
from fastdeploy.model_executor.models.llama import LlamaForCausalLM


@dataclass(frozen=True)
class DecodeShape:
    """Sizes of the static buffers that captured decode steps replay with."""

    max_decode_rows: int
    max_blocks_per_seq: int
    block_size: int
    pad_slot: int  # a KV slot in the spare block past the engine's pool: padded rows write there

    @classmethod
    def of(cls, config: EngineConfig, num_blocks: int) -> DecodeShape:
        block_size = config.cache.block_size
        spec = config.speculative
        # A verifying step has a decode row per slot: 1 + drafts per sequence; so has an MTP catch-up.
        max_decode_rows = config.scheduler.max_num_seqs * (1 + (spec.num_speculative_tokens if spec else 0))
        max_blocks_per_seq = -(-config.scheduler.max_model_len // block_size)
        return cls(max_decode_rows, max_blocks_per_seq, block_size, num_blocks * block_size)


def uses_graphs(config: EngineConfig, device: torch.device) -> bool:
    return device.type == "cuda" and not config.enforce_eager


def capture_decode_graphs(model: LlamaForCausalLM, kv_caches: list[torch.Tensor], shape: DecodeShape
                          ) -> CudaGraphRunner:
    """Decode steps captured for every batch size the runner replays (warm-up runs included)."""
    graphs = CudaGraphRunner(model, kv_caches, shape.max_decode_rows, shape.max_blocks_per_seq, shape.block_size,
                             shape.pad_slot)
    graphs.capture()
    return graphs
