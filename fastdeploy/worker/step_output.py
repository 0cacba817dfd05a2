"""What a step hands back to the engine: its packed frame, its events, and whether the frame's
mask ids are still on their way to the host; and a step launched whose output is still to come."""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from fastdeploy.common.step_frame import FrameBuffer
from fastdeploy.common.step_input import WorkerEvents


class Completion(Protocol):
    """Something that can be waited for: a `torch.cuda.Event` recorded after the last write,
    or the ids' copy that starts when first waited for (`step_packer.DeferredIdsCopy`)."""

    def synchronize(self) -> None: ...


@dataclass
class StepOutput:
    frame: FrameBuffer
    events: WorkerEvents
    # On CUDA a masked frame comes back as soon as its head (tokens, counts, logprobs, mask
    # offsets, logZ) is on the host; its mask ids, most of its bytes, are not there until
    # this completes. None: the whole frame is there.
    mask_ids_pending: Completion | None = None
    # uint8 [B, S, ceil(V/8)] on the host, B and S the frame's sequences and slots: the kept
    # sets of rows that asked for bitmaps (all zero: null), which the frame's CSR leaves empty.
    # Sequence b's accepted tokens are its first num_tokens[b] slots. None: no such row.
    mask_bits: np.ndarray | None = None

    def wait_mask_ids(self) -> None:
        """Returns once every byte of the frame is on the host."""
        if self.mask_ids_pending is not None:
            self.mask_ids_pending.synchronize()
            self.mask_ids_pending = None


class LaunchedStep:
    """A step whose device work is queued (`ModelRunner.launch`); `result()` waits for it.

    The runner's step is a generator that pauses once, after the last kernel launch before the
    frame's copy to the host; the rest (the one wait, the frame, the grammar and draft
    bookkeeping) runs in `result()`.
    """

    def __init__(self, stages: Generator[None, None, StepOutput]) -> None:
        self._stages = stages
        self._output: StepOutput | None = None
        try:
            next(stages)
        except StopIteration as done:  # nothing to sample: the step is already done
            self._output = done.value

    def result(self) -> StepOutput:
        if self._output is None:
            try:
                next(self._stages)
            except StopIteration as done:
                self._output = done.value
            else:
                raise RuntimeError("a runner step pauses once, after its launch")
        return self._output


def encode_mask_bits(bits: np.ndarray | None) -> bytes | memoryview:
    """`StepOutput.mask_bits` as one message part: its shape (3 int64) then its bytes; b"" for None."""
    if bits is None:
        return b""
    return np.asarray(bits.shape, dtype="<i8").tobytes() + np.ascontiguousarray(bits, dtype=np.uint8).tobytes()


def decode_mask_bits(part: bytes | memoryview) -> np.ndarray | None:
    """The inverse of `encode_mask_bits` (a read-only view of the part)."""
    if not len(part):
        return None
    shape = np.frombuffer(part, dtype="<i8", count=3)
    return np.frombuffer(part, dtype=np.uint8, offset=24).reshape(tuple(int(n) for n in shape))
