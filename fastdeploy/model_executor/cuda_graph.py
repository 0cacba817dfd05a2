"""CUDA graphs for decode-shaped passes: capture once per batch size, pad a pass to the next size, replay.

A decode pass launches many small kernels whose launch cost exceeds their run time at small
batch; a graph replays them with one launch. Only pure decode batches (every row one token
attending to the paged cache up to its own position, no prefill chunk) use graphs; prefill
and mixed passes run eagerly. Two passes replay this way: the target model's decode and
verification steps (`CudaGraphRunner`) and the MTP module's passes
(`fastdeploy/spec_decode/mtp_pass.py`).

Captured graphs read fixed buffers, so each pass copies its inputs into them. Padding rows
(between the real batch and the captured size) get context length 0, which the decode kernel
answers with zeros, and write their K/V to a spare slot outside the engine's block pool.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import torch

from fastdeploy.model_executor.layers.attention_metadata import AttentionMetadata
from fastdeploy.model_executor.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

Outputs = TypeVar("Outputs")


def capture_sizes(max_rows: int) -> list[int]:
    """The standard sizes below `max_rows`, plus `max_rows` itself so every batch fits."""
    sizes = [b for b in CAPTURE_SIZES if b < max_rows]
    return sizes + [max_rows]


class DecodeBuffers:
    """The fixed device inputs of a decode batch of up to `capacity` rows."""

    def __init__(self, capacity: int, max_blocks_per_seq: int, block_size: int, pad_slot: int,
                 device: torch.device) -> None:
        self.capacity = capacity
        self.block_size = block_size
        self.pad_slot = pad_slot
        self.input_ids = torch.zeros(capacity, dtype=torch.long, device=device)
        self.positions = torch.zeros(capacity, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((capacity,), pad_slot, dtype=torch.long, device=device)
        # Padding rows' tables point at the spare block; the kernel never reads them (length 0).
        self.block_tables = torch.full((capacity, max_blocks_per_seq), pad_slot // block_size, dtype=torch.long,
                                       device=device)
        self.context_lens = torch.zeros(capacity, dtype=torch.long, device=device)

    def fits(self, num_rows: int, meta: AttentionMetadata) -> bool:
        return (not meta.prefills and meta.num_decode_tokens == num_rows <= self.capacity
                and meta.decode_block_tables.shape[1] <= self.block_tables.shape[1])

    def metadata(self, batch: int) -> AttentionMetadata:
        """The first `batch` rows as attention metadata (views: a graph reads what `load` writes)."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch],
            num_decode_tokens=batch,
            decode_block_tables=self.block_tables[:batch],
            decode_context_lens=self.context_lens[:batch],
            prefills=[],
            block_size=self.block_size,
        )

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, batch: int) -> None:
        """Copy a pass of n <= batch rows in; rows n..batch-1 become padding."""
        n = input_ids.shape[0]
        width = meta.decode_block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.block_tables[:n, :width].copy_(meta.decode_block_tables, non_blocking=True)
        self.context_lens[:n].copy_(meta.decode_context_lens, non_blocking=True)
        if batch > n:  # rows a previous, larger pass left behind become padding again
            self.slot_mapping[n:batch].fill_(self.pad_slot)
            self.context_lens[n:batch].zero_()


class GraphRunner(Generic[Outputs]):
    """Captures `forward(batch)` once per size in `sizes` and replays it.

    `forward` must read only fixed buffers (sliced to `batch`) and return tensors (or a tuple of
    them); those outputs live in the graphs' pool and are valid until the next replay.
    """

    def __init__(self, forward: Callable[[int], Outputs], sizes: Sequence[int], name: str) -> None:
        self.forward = forward
        self.sizes = list(sizes)
        self.name = name
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, Outputs] = {}

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, all sharing one memory pool."""
        pool = None
        for batch in reversed(self.sizes):
            self.forward(batch)  # compiles the Triton kernels and settles the allocator before capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[batch] = self.forward(batch)
            pool = graph.pool()
            self.graphs[batch] = graph
        torch.cuda.synchronize()
        logger.info("captured %s CUDA graphs for batch sizes %s", self.name, self.sizes)

    def padded_size(self, n: int) -> int:
        return next(b for b in self.sizes if b >= n)

    def replay(self, batch: int) -> Outputs:
        self.graphs[batch].replay()
        return self.outputs[batch]


class CudaGraphRunner:
    """The target model's decode (and verification) steps as CUDA graphs."""

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
        self.sizes = capture_sizes(max_num_seqs)
        self.buffers = DecodeBuffers(self.sizes[-1], max_blocks_per_seq, block_size, pad_slot, kv_caches[0].device)
        self.graphs = GraphRunner(self._forward, self.sizes, "decode")

    def _forward(self, batch: int) -> torch.Tensor:
        b = self.buffers
        return self.model(b.input_ids[:batch], b.positions[:batch], b.metadata(batch), self.kv_caches)

    def capture(self) -> None:
        self.graphs.capture()

    def can_run(self, num_tokens: int, meta: AttentionMetadata) -> bool:
        return self.buffers.fits(num_tokens, meta)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [n, hidden] of a decode step; valid until the next replay."""
        n = input_ids.shape[0]
        batch = self.graphs.padded_size(n)
        self.buffers.load(input_ids, positions, meta, batch)
        return self.graphs.replay(batch)[:n]
