"""A step whose device work is queued (`ModelRunner.launch`) and what finishing it needs
(`ModelRunner.finish`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastdeploy.common.step_input import ChunkInput, StepInput, WorkerEvents
from fastdeploy.model_executor.device_inputs import upload_int64
from fastdeploy.model_executor.layers.attention_metadata import AttentionMetadata
from fastdeploy.model_executor.layers.sample.metadata import SamplerOutput, SamplingMetadata
from fastdeploy.worker.sequence_state import WorkerSequence
from fastdeploy.worker.step_output import StepOutput
from fastdeploy.worker.verify_kernels import PlacedRows, VerifiedSlots, place_rows


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
    # The drafts verified, on the device [B, S - 1], where the step before made them there
    # (`slot_drafts` then holds placeholders of the right lengths); None: `slot_drafts` holds them.
    device_drafts: torch.Tensor | None = None
    verified: VerifiedSlots | None = None  # a verify step sent with a successor: its accept counts
    # int64 [B] on the host (copied after the frame's wait): each sequence's real drafts among
    # `device_drafts`, where the device's lookups may find fewer than placed; None: all are real.
    num_proposed: torch.Tensor | None = None


@dataclass
class SampledTokens:
    """A launched step's sampled tokens on the device, one per sampled sequence: where the
    next step, scheduled before they are known on the host, reads its in-flight tokens."""

    seq_ids: list[int]  # in the sampler's row order
    tokens: torch.Tensor  # int64 [len(seq_ids)]: each sequence's newest token (a verify step's last accepted)
    # A verify step: the drafts each sequence accepted (int64 [len(seq_ids)]). The next step's
    # rows of a sequence sit that many positions further on than the host, which has not seen
    # the count, placed them. None: a step without drafts.
    advance: torch.Tensor | None = None
    # Drafts made on the device after this step (the MTP module, or n-gram lookup): int64
    # [len(seq_ids), cap], the next step's drafts (-1 where a lookup found fewer).
    drafts: torch.Tensor | None = None

    def _rows(self, slots: list[tuple[int, int]]) -> list[int]:
        row_of = {seq_id: row for row, seq_id in enumerate(self.seq_ids)}
        missing = [seq_id for _, seq_id in slots if seq_id not in row_of]
        if missing:
            raise RuntimeError(f"in-flight tokens of sequences the last step did not sample: {missing}")
        return [row_of[seq_id] for _, seq_id in slots]

    def fill(self, input_ids: torch.Tensor, slots: list[tuple[int, int]], device: torch.device) -> None:
        """input_ids[flat] = this step's token of seq_id, for each (flat, seq_id) of `slots`."""
        flat, rows = upload_int64([[f for f, _ in slots], self._rows(slots)], device)
        # A row the kept-set kernel left unsettled holds a negative marker until it is redrawn
        # (and the step run again); clamped so the embedding never reads outside the table.
        input_ids[flat] = self.tokens[rows].clamp(min=0)

    def place(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
              slots: list[tuple[int, int]], widths: list[int], sampled_seq_ids: list[int],
              device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """`fill`, for a step whose in-flight sequences may also take their drafts from this one
        and sit further on than the host placed them: each (flat, seq_id) of `slots` is followed
        by `widths` draft rows (decode rows, the run the host laid out at its guess of the
        position). The run's token ids come from `drafts`, and its positions, context lengths and
        cache slots move on by `advance`, all on the device.

        Returns the drafts each of the step's sampled sequences (`sampled_seq_ids`, the sampler's
        row order) verifies, int64 [len(sampled_seq_ids), max(widths)], -1 past a sequence's own
        (for the verification), and how many of each are real drafts (int64: a lookup may find
        fewer than placed); None, None when no slot has drafts."""
        if self.advance is None and self.drafts is None:
            self.fill(input_ids, slots, device)
            return None, None
        if any(w and self.drafts is None for w in widths):
            raise RuntimeError("draft rows of in-flight sequences, but the step before drafted none")
        if self.advance is not None and max(f + w for (f, _), w in zip(slots, widths, strict=True)) \
                >= meta.num_decode_tokens:
            raise RuntimeError("an in-flight sequence that moved on is not a run of decode rows")
        rows = self._rows(slots)
        flat: list[int] = []
        source: list[int] = []
        offset: list[int] = []
        for (first, _), row, width in zip(slots, rows, widths, strict=True):
            flat.extend(range(first, first + width + 1))
            source.extend([row] * (width + 1))
            offset.extend(range(width + 1))
        # Per sampled sequence: its row here and how many drafts it verifies (0: none).
        drafting = {seq_id: (row, width) for (_, seq_id), row, width in zip(slots, rows, widths, strict=True)}
        by_sampler = [drafting.get(seq_id, (0, 0)) for seq_id in sampled_seq_ids]
        placed = PlacedRows(*upload_int64([flat, source, offset, [r for r, _ in by_sampler],
                                           [w for _, w in by_sampler]], device))
        return place_rows(placed, self.tokens, self.drafts, self.advance, input_ids, positions,
                          meta.decode_context_lens, meta.decode_block_tables, meta.slot_mapping, meta.block_size,
                          max(widths))


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
