"""What a step hands back to the engine: its packed frame, its events, and whether the frame's
mask ids are still on their way to the host."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fastdeploy.common.step_frame import FrameBuffer
from fastdeploy.common.step_input import WorkerEvents
from fastdeploy.ops.step_packer import Completion


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


def encode_mask_bits(bits: np.ndarray | None) -> tuple[bytes, bytes | memoryview]:
    """`StepOutput.mask_bits` as two message parts: its shape (3 int64) and its bytes, a view of
    the array's own buffer (sent without a copy: a step's bitmaps are megabytes); (b"", b"") for None."""
    if bits is None:
        return b"", b""
    flat = np.ascontiguousarray(bits, dtype=np.uint8)
    return np.asarray(flat.shape, dtype="<i8").tobytes(), flat.reshape(-1).data


def decode_mask_bits(shape_part: bytes | memoryview, bits_part: bytes | memoryview) -> np.ndarray | None:
    """The inverse of `encode_mask_bits` (a read-only view of the bytes' part)."""
    if not len(shape_part):
        return None
    shape = tuple(int(n) for n in np.frombuffer(shape_part, dtype="<i8", count=3))
    return np.frombuffer(bits_part, dtype=np.uint8).reshape(shape)
