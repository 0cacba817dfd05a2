"""CUDA graphs for decode steps: capture once per batch size, pad a step to the next size, replay.

A decode step launches hundreds of small kernels whose launch cost exceeds their run time at
small batch; a graph replays them with one launch. Only pure decode steps (one token per
sequence, no prefill chunk) use graphs; prefill and mixed steps run eagerly.

Captured graphs read fixed buffers, so each step copies its inputs into them. Padding rows
(between the real batch and the captured size) get context length 0, which the decode kernel
answers with zeros, and write their K/V to a spare slot outside the engine's block pool.
"""

from __future__ import annotations

import logging

import torch

from fastdeploy.model_executor.layers.attention_metadata import AttentionMetadata
from fastdeploy.model_executor.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The standard sizes up to `max_num_seqs`, plus `max_num_seqs` itself so every batch fits."""
    sizes = [b for b in CAPTURE_SIZES if b < max_num_seqs]
    return sizes + [max_num_seqs]


class CudaGraphRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[torch.Tensor],
        max_num_seqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        pad_slot: int,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.pad_slot = pad_slot
        self.sizes = capture_sizes(max_num_seqs)
        device = kv_caches[0].device
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), pad_slot, dtype=torch.long, device=device)
        # Padding rows' tables point at the spare block; the kernel never reads them (length 0).
        self.block_tables = torch.full((n, max_blocks_per_seq), pad_slot // block_size, dtype=torch.long,
                                       device=device)
        self.context_lens = torch.zeros(n, dtype=torch.long, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _forward(self, batch: int) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch],
            num_decode_tokens=batch,
            decode_block_tables=self.block_tables[:batch],
            decode_context_lens=self.context_lens[:batch],
            prefills=[],
            block_size=self.block_size,
        )
        return self.model(self.input_ids[:batch], self.positions[:batch], meta, self.kv_caches)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, all sharing one memory pool."""
        pool = None
        for batch in reversed(self.sizes):
            self._forward(batch)  # compiles the Triton kernels and settles the allocator before capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[batch] = self._forward(batch)
            pool = graph.pool()
            self.graphs[batch] = graph
        torch.cuda.synchronize()
        logger.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def can_run(self, num_tokens: int, meta: AttentionMetadata) -> bool:
        return (not meta.prefills and meta.num_decode_tokens == num_tokens <= self.sizes[-1]
                and meta.decode_block_tables.shape[1] <= self.block_tables.shape[1])

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [n, hidden] of a decode step; valid until the next replay."""
        n = input_ids.shape[0]
        batch = next(b for b in self.sizes if b >= n)
        width = meta.decode_block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.block_tables[:n, :width].copy_(meta.decode_block_tables, non_blocking=True)
        self.context_lens[:n].copy_(meta.decode_context_lens, non_blocking=True)
        if batch > n:  # rows a previous, larger step left behind become padding again
            self.slot_mapping[n:batch].fill_(self.pad_slot)
            self.context_lens[n:batch].zero_()
        self.graphs[batch].replay()
        return self.outputs[batch][:n]
