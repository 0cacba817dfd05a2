"""Custom ops (C++ / CUDA sources in custom_ops/) and their Python entry points."""

from fastdeploy.ops.step_packer import pack_step_slots, unpack_step_frame_op

__all__ = ["pack_step_slots", "unpack_step_frame_op"]
