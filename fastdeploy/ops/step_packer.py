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

import torch

from fastdeploy.output.step_frame import HAS_LOGPROBS, HAS_MASK, StepFrame
from fastdeploy.output.step_slots import StepSlots

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


def pack_step_slots_copying_ids(slots: StepSlots, copy_stream: torch.cuda.Stream
                                ) -> tuple[torch.Tensor, StepFrame, torch.cuda.Event]:
    """CUDA, for slots of one accepted slot per sequence over a CSR that starts at 0 (a
    sampler's own): the frame's mask ids are then `mask_ids[:M]` exactly as they lie.

    Returns the pinned frame, its unpacked views and an event, once the head is on the host.
    The op itself queues the ids' copy on `copy_stream` (a copy engine, so the next step's
    kernels on the compute stream never queue behind it) the moment the head lands; wait on
    the event before reading them.
    """
    load_ops(cuda=True)
    packed = torch.ops.fastdeploy_ops.pack_step_slots_split(*_op_args(slots), copy_stream.cuda_stream)
    done = torch.cuda.Event()
    done.record(copy_stream)
    return packed, unpack_step_frame_op(packed), done


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
