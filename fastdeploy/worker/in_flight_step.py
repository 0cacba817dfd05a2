"""A step whose device work is queued (`ModelRunner.launch`) and what finishing it needs
(`ModelRunner.finish`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastdeploy.common.step_input import ChunkInput, WorkerEvents
from fastdeploy.model_executor.layers.sample.metadata import SamplerOutput, SamplingMetadata
from fastdeploy.worker.sequence_state import WorkerSequence
from fastdeploy.worker.step_output import StepOutput


@dataclass
class QueuedSampling:
    """A sampled step between its launch and its frame: the sampler's output still on the
    device, and what the frame, the rare redraw and the MTP step after it read."""

    message_id: int
    chunks: list[ChunkInput]  # as run: drafted decode chunks carry their drafts
    drafts: dict[int, list[int]]  # per drafting sequence, non-empty
    seq_ids: list[int]  # the sampled sequences, in the sampler's row order
    slot_drafts: list[list[int]]  # drafts per sampled sequence ([] for none)
    states: list[WorkerSequence]  # per sampled sequence
    hidden: torch.Tensor  # the step's hidden states: the MTP module's input
    logits: torch.Tensor  # float32 [rows, V]: kept only for a redraw
    metadata: SamplingMetadata
    # Only the CUDA kept-set kernel can leave a truncating row unsettled; only then may the
    # step be sampled again, and only then are the seeded generators' states worth keeping.
    may_redraw: bool
    rng_states: list[torch.Tensor | None]  # per sampler row, before sampling; [] unless may_redraw
    sampled: SamplerOutput | None  # None once packed (its memory may go to a redraw)


@dataclass
class InFlightStep:
    """The handle `ModelRunner.launch` returns; `ModelRunner.finish` turns it into the output."""

    events: WorkerEvents
    sampling: QueuedSampling | None = None
    # A step that samples nothing is finished at launch.
    finished: StepOutput | None = None
