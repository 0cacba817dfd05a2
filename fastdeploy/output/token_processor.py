"""Turns a worker frame into per-request deltas and decides which sequences finished.

Two stages, so the engine can put the second one where it costs nothing: `apply` appends
each sequence's accepted tokens and decides finishes (the next step is scheduled from
them), building the deltas without their sampling masks; `attach_masks` cuts the frame's
CSR into the masked deltas' runs. `process` does both at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
import numpy as np

from fastdeploy.common.request import RequestDelta
from fastdeploy.common.sampling_masks import LOGZ_BYTES, bitmap_rows, logz_buffer, rows_present, split_runs
from fastdeploy.common.step_frame import FrameBuffer, StepFrame, split_by_sequence, unpack_step_frame
from fastdeploy.scheduler.sequence import Sequence


class MaskedRun(msgspec.Struct, gc=False):
    """A delta whose sampling masks are still to be cut from the frame: its sequence's run is
    the frame's `run`-th, of which the delta keeps the first `kept` tokens.

    A struct rather than a dataclass: one is built per masked sequence per step, and a struct
    is built in C (about 0.1 µs against 0.26 µs), untracked by the garbage collector (it holds
    no cycle)."""

    delta: RequestDelta
    run: int
    kept: int
    bitmap: bool = False  # the request takes its masks as bitmaps


@dataclass
class AppliedStep:
    """A frame whose tokens are applied: one delta per sequence still running, split into the
    masked ones, waiting for `TokenProcessor.attach_masks`, and the rest (so an engine that
    holds the masked ones back needs no pass over `results` to find the others)."""

    frame: StepFrame
    # uint8 [B, S, ceil(V/8)]: the bitmaps of sequences that asked for them (`StepOutput.mask_bits`).
    mask_bits: np.ndarray | None = None
    results: list[tuple[Sequence, RequestDelta]] = field(default_factory=list)
    masked: list[MaskedRun] = field(default_factory=list)
    unmasked: list[RequestDelta] = field(default_factory=list)


class TokenProcessor:
    def __init__(self, eos_token_ids: list[int], max_model_len: int) -> None:
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len

    def _finish_reason(self, seq: Sequence, token: int) -> tuple[str | None, int | None]:
        params = seq.params
        if token in params.stop_token_ids:
            return "stop", token
        if not params.ignore_eos and token in self.eos_token_ids:
            return "stop", None
        if params.max_tokens is not None and len(seq.output_token_ids) >= params.max_tokens:
            return "length", None
        if seq.num_tokens >= self.max_model_len:
            return "length", None
        return None, None

    def apply(self, frame_bytes: FrameBuffer, sequences: dict[int, Sequence],
              grammar_terminated: frozenset[int] = frozenset(), mask_bits: np.ndarray | None = None) -> AppliedStep:
        """Append accepted tokens to their sequences; one delta per sequence in the frame, its
        sampling masks not yet attached.

        Tokens after a finishing token within one step (speculative runs) are dropped.
        A sequence whose grammar completed this step finishes with "stop". The frame's mask
        ids are not read here: on CUDA they may still be on their way to the host.
        """
        frame = unpack_step_frame(frame_bytes)
        applied = AppliedStep(frame, mask_bits)
        has_mask = frame.mask_offsets is not None
        for run, part in enumerate(split_by_sequence(frame, with_masks=False)):
            seq = sequences.get(part.seq_id)
            if seq is None:  # aborted while the step ran
                continue
            finish_reason = stop_reason = None
            kept = 0
            for token in part.token_ids:
                seq.output_token_ids.append(token)
                kept += 1
                finish_reason, stop_reason = self._finish_reason(seq, token)
                if finish_reason:
                    break
            if finish_reason is None and part.seq_id in grammar_terminated:
                finish_reason = "stop"
            delta = RequestDelta(
                request_id=seq.request_id,
                token_ids=part.token_ids[:kept],
                logprobs=part.logprobs[:kept] if part.logprobs is not None else None,
                logprob_token_ids=part.logprob_token_ids[:kept] if part.logprob_token_ids is not None else None,
                ranks=part.ranks[:kept] if part.ranks is not None else None,
                finish_reason=finish_reason,
                stop_reason=stop_reason,
                num_prompt_tokens=len(seq.prompt_token_ids),
            )
            # Rows that opted out travel as empty CSR rows; they must not read as "null".
            if has_mask and seq.return_sampling_mask:
                applied.masked.append(MaskedRun(delta, run, kept, seq.sampling_mask_bitmap))
            else:
                applied.unmasked.append(delta)
            applied.results.append((seq, delta))
        return applied

    def attach_masks(self, applied: AppliedStep) -> None:
        """Give each masked delta its runs of the frame's CSR (views of the frame) and logZ.
        The frame's mask ids must be on the host."""
        if not applied.masked:
            return
        frame = applied.frame
        if frame.mask_offsets is None or frame.mask_ids is None or frame.logz is None:
            raise ValueError("sequences asked for sampling masks but the step sent none")
        counts = frame.num_tokens.tolist()
        runs = split_runs(frame.mask_offsets, frame.mask_ids, counts)
        starts = frame.num_tokens.cumsum().tolist()
        logz = logz_buffer(frame.logz)
        bits = applied.mask_bits
        present = None  # bool [B, S]: one pass over the step's bitmaps, not one per delta
        for masked in applied.masked:
            count = counts[masked.run]
            start = starts[masked.run] - count
            if masked.bitmap:
                if bits is None:
                    raise ValueError("a sequence asked for bitmaps but the step sent none")
                if present is None:
                    present = rows_present(bits)
                masked.delta.sampling_mask = bitmap_rows(bits[masked.run, :masked.kept],
                                                         present[masked.run, :masked.kept])
            else:
                run = runs[masked.run]
                # Most deltas keep their whole run; `head` is the cut at a finishing token.
                masked.delta.sampling_mask = run if masked.kept == count else run.head(masked.kept)
            masked.delta.logz = logz[start * LOGZ_BYTES:(start + masked.kept) * LOGZ_BYTES]
