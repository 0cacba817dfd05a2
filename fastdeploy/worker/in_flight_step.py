"""A step whose device work is queued (`ModelRunner.launch`) and what finishing it needs
(`ModelRunner.finish`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastdeploy.common.step_input import ChunkInput, StepInput, WorkerEvents
from fastdeploy.model_executor.device_inputs import upload_int64
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
    step: StepInput  # as sent: a redraw may have to run a successor again
    launch_index: int  # the runner's launch count when this step launched
    sampled_event: torch.cuda.Event | None  # CUDA: recorded after the sampler


@dataclass
class SampledTokens:
    """A launched step's sampled tokens on the device, one per sampled sequence: where the
    next step, scheduled before they are known on the host, reads its in-flight tokens."""

    seq_ids: list[int]  # in the sampler's row order
    tokens: torch.Tensor  # int64 [len(seq_ids)]

    def fill(self, input_ids: torch.Tensor, slots: list[tuple[int, int]], device: torch.device) -> None:
        """input_ids[flat] = this step's token of seq_id, for each (flat, seq_id) of `slots`."""
        row_of = {seq_id: row for row, seq_id in enumerate(self.seq_ids)}
        missing = [seq_id for _, seq_id in slots if seq_id not in row_of]
        if missing:
            raise RuntimeError(f"in-flight tokens of sequences the last step did not sample: {missing}")
        flat, rows = upload_int64([[f for f, _ in slots], [row_of[seq_id] for _, seq_id in slots]], device)
        # A row the kept-set kernel left unsettled holds a negative marker until it is redrawn
        # (and the step run again); clamped so the embedding never reads outside the table.
        input_ids[flat] = self.tokens[rows].clamp(min=0)


@dataclass
class InFlightStep:
    """The handle `ModelRunner.launch` returns; `ModelRunner.finish` turns it into the output."""

    events: WorkerEvents
    sampling: QueuedSampling | None = None
    # A step that samples nothing is finished at launch; one finished early keeps its output here.
    finished: StepOutput | None = None
    # The worker process has sent its frame (or its failure): once per step, maybe before the
    # launch of the step behind it returned (`ModelRunner.on_finished_early`).
    replied: bool = False

    @property
    def unfinished(self) -> bool:
        """Whether `ModelRunner.finish` has yet to run for it."""
        return self.finished is None and self.sampling is not None and self.sampling.sampled is not None
