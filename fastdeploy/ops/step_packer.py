"""The step packer: a step's slot layout -> its packed frame, behind one interface.

`StepPacker.pack(slots) -> PackedStep` has three implementations, one chosen per runner at
start-up (`choose_packer`):

* `ReferencePacker`: numpy (`gather_step_slots` + `pack_step_frame`); the format's
  definition, used where the C++ op is not built and by tests as the oracle.
* `CpuOpPacker`: the C++ op (`custom_ops/step_packer.cpp`).
* `CudaOpPacker`: the CUDA op (`custom_ops/step_packer_cuda.cu`): the gather runs on the
  device and the frame is written straight to pinned host memory; a masked frame comes back
  once its head is on the host, its mask ids following on a copy stream.

All three produce the same bytes. Every frame is read back with the one codec,
`common.step_frame.unpack_step_frame`, as views of the packed buffer.

The CUDA extension is built by `pip install -e .` where CUDA was there at build time; one
that was not built is compiled on first use with `torch.utils.cpp_extension.load` (about a
minute).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from fastdeploy.common.extensions import is_built, load_extension
from fastdeploy.common.step_frame import StepFrame, pack_step_frame, unpack_step_frame
from fastdeploy.common.step_slots import StepSlots, gather_step_slots

_lock = threading.Lock()


def load_ops(cuda: bool = False) -> None:
    """Registers torch.ops.fastdeploy_ops.* (the CPU library, and the CUDA kernels if asked)."""
    with _lock:
        load_extension("_step_packer_cpu")  # defines the ops; the CUDA library only adds kernels
        if cuda:
            load_extension("_step_packer_cuda")


def op_args(slots: StepSlots) -> tuple:
    """The slots as the packer ops' positional arguments."""
    lp = (slots.lp_ids, slots.lp_values, slots.ranks) if slots.has_logprobs else (None, None, None)
    mask = (slots.mask_offsets, slots.mask_ids, slots.logz) if slots.has_mask else (None, None, None)
    return (slots.message_id, slots.seq_ids, slots.accept_counts, slots.token_ids, slots.num_logprobs, *lp, *mask)


class Completion(Protocol):
    """Something that can be waited for: a `torch.cuda.Event` recorded after the last write,
    or the ids' copy that starts when first waited for (`DeferredIdsCopy`)."""

    def synchronize(self) -> None: ...


@dataclass
class PackedStep:
    """A step's packed frame on the host and its unpacked views."""

    buffer: memoryview  # the frame bytes (on CUDA a view of the pinned buffer the op wrote)
    frame: StepFrame  # numpy views into `buffer`
    # The frame's mask ids are still on their way to the host until this completes; None: all there.
    mask_ids_pending: Completion | None = None
    # uint8 [B, S, ceil(V/8)] on the host: `slots.mask_bits`, which travel beside the frame.
    mask_bits: np.ndarray | None = None


class StepPacker(Protocol):
    def pack(self, slots: StepSlots) -> PackedStep:
        """The step's frame; on CUDA the step's one wait for the device."""


def _tensor_step(packed: torch.Tensor, mask_bits: np.ndarray | None,
                 pending: Completion | None = None) -> PackedStep:
    buffer = packed.numpy().data  # the array keeps the tensor, and so its memory, alive
    return PackedStep(buffer, unpack_step_frame(buffer), pending, mask_bits)


class ReferencePacker:
    """numpy: the definition of the frame the ops are held to, byte for byte."""

    def pack(self, slots: StepSlots) -> PackedStep:
        buffer = memoryview(pack_step_frame(gather_step_slots(slots)))
        bits = None if slots.mask_bits is None else slots.mask_bits.detach().cpu().numpy()
        return PackedStep(buffer, unpack_step_frame(buffer), None, bits)


class CpuOpPacker:
    """The C++ op, for slots in host memory."""

    def __init__(self) -> None:
        load_ops()

    def pack(self, slots: StepSlots) -> PackedStep:
        bits = None if slots.mask_bits is None else slots.mask_bits.numpy()
        return _tensor_step(torch.ops.fastdeploy_ops.pack_step_slots(*op_args(slots)), bits)


class DeferredIdsCopy:
    """The mask ids of a frame whose head is on the host, still in device memory: they are
    copied in on a copy stream when first asked for (`start`, or `synchronize`, which waits).

    The copy is not queued with the head: the host's time between the head landing and the
    next step's launch is time the GPU idles, and queueing a copy costs a round of Python and
    CUDA calls. The engine asks for the ids once the next step is queued, so the copy engine
    moves them beside that step's kernels. The ids need no device-side wait: the head, read
    after the compaction on the same stream, was on the host before this object existed.
    """

    def __init__(self, frame_bytes: torch.Tensor, frame_ids: np.ndarray, device_ids: torch.Tensor,
                 copy_stream: torch.cuda.Stream) -> None:
        self._frame_bytes = frame_bytes
        self._frame_ids = frame_ids  # the frame's (not yet written) view of the ids
        self._device_ids: torch.Tensor | None = device_ids
        self._stream = copy_stream
        self._done: torch.cuda.Event | None = None

    def start(self) -> None:
        """Queue the copy (once)."""
        if self._done is not None or self._device_ids is None:
            return
        num_ids = len(self._frame_ids)
        offset = self._frame_ids.__array_interface__["data"][0] - self._frame_bytes.data_ptr()
        with torch.cuda.stream(self._stream):
            if num_ids:
                # A non-blocking copy into pinned memory also tells the pinned pool to keep the
                # block until the copy is done.
                dest = self._frame_bytes.narrow(0, offset, 4 * num_ids).view(torch.int32)
                dest.copy_(self._device_ids[:num_ids], non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record()
        self._device_ids.record_stream(self._stream)  # not reused before the copy ends, even if dropped
        self._device_ids = None

    def synchronize(self) -> None:
        """Returns once the ids are in the frame."""
        self.start()
        assert self._done is not None
        self._done.synchronize()


class CudaOpPacker:
    """The CUDA op, for slots in device memory. Which variant runs is decided per step:

    * no mask: the whole frame in one op (the step's one synchronisation);
    * mask, one slot per sequence (no drafts): the head comes back first and the mask ids, most
      of a masked frame's bytes, cross PCIe later on `copy_stream`, a copy engine, beside the
      next step's kernels (`DeferredIdsCopy`);
    * mask with drafts: a kernel gathers the accepted slots' ids behind the head (the split op).
    """

    def __init__(self, copy_stream: torch.cuda.Stream) -> None:
        load_ops(cuda=True)
        self._copy_stream = copy_stream

    def pack(self, slots: StepSlots) -> PackedStep:
        bits = _bitmaps_to_host(slots.mask_bits) if slots.mask_bits is not None else None
        if slots.has_mask and slots.token_ids.shape[1] == 1:
            step = self._pack_copying_ids(slots, bits)
            if step is not None:
                return step
        if slots.has_mask:
            packed = torch.ops.fastdeploy_ops.pack_step_slots_split(*op_args(slots))
            written = torch.cuda.Event()
            written.record()  # the ids' kernel was queued on this stream by the op
            return _tensor_step(packed, bits, written)
        return _tensor_step(torch.ops.fastdeploy_ops.pack_step_slots(*op_args(slots)), bits)

    def _pack_copying_ids(self, slots: StepSlots, bits: np.ndarray | None) -> PackedStep | None:
        """For slots of one accepted slot per sequence over a CSR that starts at 0 (a sampler's
        own): the frame's mask ids are then `mask_ids[:M]` exactly as they lie. None when a
        sequence accepted no slot (the ids are then not in frame order); a sampled step without
        drafts never does that, so the split op's second pass is only a safety net."""
        packed = torch.ops.fastdeploy_ops.pack_step_slots_split(*op_args(slots), False)
        step = _tensor_step(packed, bits)
        if len(step.frame.token_ids) != slots.token_ids.shape[0]:
            return None
        assert step.frame.mask_ids is not None and slots.mask_ids is not None
        step.mask_ids_pending = DeferredIdsCopy(packed, step.frame.mask_ids, slots.mask_ids, self._copy_stream)
        return step


def _bitmaps_to_host(bits: torch.Tensor) -> np.ndarray:
    """The step's bitmaps on the host. The copy is queued into pinned memory ahead of the
    frame's head, so the head's one wait covers it: a blocking copy after the head would be a
    second synchronisation in the step."""
    host = torch.empty(bits.shape, dtype=torch.uint8, pin_memory=True)
    host.copy_(bits, non_blocking=True)
    return host.numpy()


def choose_packer(device: torch.device) -> StepPacker:
    """The packer for slots on `device`: the CUDA op there; on the host the C++ op where it is
    built, else the numpy reference (same bytes, no compiler needed)."""
    if device.type == "cuda":
        return CudaOpPacker(torch.cuda.Stream(device))
    if is_built("_step_packer_cpu"):
        return CpuOpPacker()
    return ReferencePacker()
