"""What a step hands back to the engine: its packed frame, its events, and whether the frame's
mask ids are still on their way to the host."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from fastdeploy.output.step_frame import FrameBuffer
from fastdeploy.worker.step_input import WorkerEvents


class Completion(Protocol):
    """Something that can be waited for: a `torch.cuda.Event` recorded after the last write."""

    def synchronize(self) -> None: ...


@dataclass
class StepOutput:
    frame: FrameBuffer
    events: WorkerEvents
    # On CUDA a masked frame comes back as soon as its head (tokens, counts, logprobs, mask
    # offsets, logZ) is on the host; its mask ids, most of its bytes, are still being written
    # behind it until this completes. None: the whole frame is there.
    mask_ids_pending: Completion | None = None

    def wait_mask_ids(self) -> None:
        """Returns once every byte of the frame is on the host."""
        if self.mask_ids_pending is not None:
            self.mask_ids_pending.synchronize()
            self.mask_ids_pending = None
