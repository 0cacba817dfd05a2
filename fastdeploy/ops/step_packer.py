"""The packed step output ops (`custom_ops/step_packer*.{cpp,cu}`) and their Python entry points.

`pack_step_slots` turns a step's slot layout into the frame bytes on the device the
tensors live on (C++ on CPU; on CUDA the gather runs on the device and the frame is
written straight to pinned host memory). `unpack_step_frame_op` is the engine side:
frame bytes -> `StepFrame` of zero-copy views. Both are held byte for byte to the
Python reference (`pack_step_slots_reference`, `unpack_step_frame`).

The extensions are built by `pip install -e .` (the CUDA one only where CUDA was there
at build time); one that was not built is compiled on first use with
`torch.utils.cpp_extension.load` (about a minute).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import threading
import warnings

import numpy as np
import torch

from fastdeploy.common.step_frame import HAS_LOGPROBS, HAS_MASK, StepFrame
from fastdeploy.common.step_slots import StepSlots

CUSTOM_OPS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                              "custom_ops")
_SOURCES = {"_step_packer_cpu": "step_packer.cpp", "_step_packer_cuda": "step_packer_cuda.cu"}
_lock = threading.Lock()


@functools.cache
def _load(module: str) -> None:
    """Loads a built extension of this package, or builds it just in time from custom_ops/."""
    spec = importlib.util.find_spec(f"fastdeploy.ops.{module}")
    if spec is not None and spec.origin:
        torch.ops.load_library(spec.origin)
        return
    source = os.path.join(CUSTOM_OPS_DIR, _SOURCES[module])
    if not os.path.exists(source):
        raise RuntimeError(f"fastdeploy.ops.{module} is not built and {source} is missing")
    from torch.utils.cpp_extension import load

    load(name=f"fastdeploy{module}", sources=[source], extra_include_paths=[CUSTOM_OPS_DIR],
         extra_cflags=["-O3"], extra_cuda_cflags=["-O3"], is_python_module=False)


def load_ops(cuda: bool = False) -> None:
    """Registers torch.ops.fastdeploy_ops.* (the CPU library, and the CUDA kernels if asked)."""
    with _lock:
        _load("_step_packer_cpu")  # defines the ops; the CUDA library only adds kernels
        if cuda:
            _load("_step_packer_cuda")


def _op_args(slots: StepSlots) -> tuple:
    lp = (slots.lp_ids, slots.lp_values, slots.ranks) if slots.has_logprobs else (None, None, None)
    mask = (slots.mask_offsets, slots.mask_ids, slots.logz) if slots.has_mask else (None, None, None)
    return (slots.message_id, slots.seq_ids, slots.accept_counts, slots.token_ids, slots.num_logprobs, *lp, *mask)


def pack_step_slots_tensor(slots: StepSlots) -> torch.Tensor:
    """The frame as a uint8 CPU tensor (pinned when the slots are on CUDA)."""
    load_ops(cuda=slots.token_ids.is_cuda)
    return torch.ops.fastdeploy_ops.pack_step_slots(*_op_args(slots))


def pack_step_slots(slots: StepSlots) -> bytes:
    """The frame bytes of a step; runs on the device of `slots.token_ids`."""
    return pack_step_slots_tensor(slots).numpy().tobytes()


def pack_step_slots_split(slots: StepSlots) -> torch.Tensor:
    """CUDA: the frame as a pinned uint8 tensor, returned once all of it but the mask ids is on
    the host; the mask ids are still being written by a kernel on the current stream. Record
    an event on that stream right after the call and wait on it before reading them (the
    pinned pool does not reuse the buffer before the kernel is done, even if it is dropped)."""
    load_ops(cuda=True)
    return torch.ops.fastdeploy_ops.pack_step_slots_split(*_op_args(slots))


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
        self._device_ids = device_ids
        self._stream = copy_stream
        self._done: torch.cuda.Event | None = None

    def start(self) -> None:
        """Queue the copy (once)."""
        if self._done is not None:
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
        self._done.synchronize()


def pack_step_slots_copying_ids(slots: StepSlots, copy_stream: torch.cuda.Stream
                                ) -> tuple[torch.Tensor, StepFrame, DeferredIdsCopy]:
    """CUDA, for slots of one accepted slot per sequence over a CSR that starts at 0 (a
    sampler's own): the frame's mask ids are then `mask_ids[:M]` exactly as they lie.

    Returns the pinned frame, its unpacked views and the ids' pending copy (a plain
    device-to-host copy on `copy_stream`, a copy engine, so no kernel of a later step queues
    behind it), once the head is on the host. Synchronize the copy before reading the ids.
    """
    load_ops(cuda=True)
    packed = torch.ops.fastdeploy_ops.pack_step_slots_split(*_op_args(slots), False)
    frame = unpack_step_frame_op(packed)
    if slots.token_ids.shape[1] != 1 or len(frame.token_ids) != slots.token_ids.shape[0]:
        raise ValueError("the ids lie in frame order only when every sequence has one accepted slot")
    return packed, frame, DeferredIdsCopy(packed, frame.mask_ids, slots.mask_ids, copy_stream)


def pack_step_slots_staged(slots: StepSlots) -> torch.Tensor:
    """CUDA alternative kept for comparison: device buffer, size read back, then one exact copy."""
    load_ops(cuda=True)
    return torch.ops.fastdeploy_ops.pack_step_slots_staged(*_op_args(slots))


def _as_uint8(buf: bytes | bytearray | memoryview | torch.Tensor) -> torch.Tensor:
    if isinstance(buf, torch.Tensor):
        return buf
    view = memoryview(buf)
    if view.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    if not view.readonly:
        return torch.frombuffer(view, dtype=torch.uint8)
    # Frames arrive as immutable bytes; the unpacker only makes read views of them.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
        return torch.frombuffer(view, dtype=torch.uint8)


def unpack_step_frame_op(buf: bytes | bytearray | memoryview | torch.Tensor) -> StepFrame:
    """Frame bytes -> StepFrame whose arrays are numpy views into `buf` (no copy)."""
    load_ops()
    arrays = [t.numpy() for t in torch.ops.fastdeploy_ops.unpack_step_frame(_as_uint8(buf))]
    meta, rest = arrays[0], iter(arrays[4:])
    flag = int(meta[1]) & 0xFF
    frame = StepFrame(message_id=int(meta[0]), seq_ids=arrays[1], num_tokens=arrays[2], token_ids=arrays[3])
    if flag & HAS_LOGPROBS:
        frame.lp_ids, frame.lp_values, frame.ranks = next(rest), next(rest), next(rest)
    if flag & HAS_MASK:
        frame.mask_offsets, frame.mask_ids, frame.logz = next(rest), next(rest), next(rest)
    return frame
