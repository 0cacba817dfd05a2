"""Custom ops (C++ / CUDA sources in custom_ops/) and their Python entry points."""

from fastdeploy.ops.step_packer import PackedStep, StepPacker, choose_packer

__all__ = ["PackedStep", "StepPacker", "choose_packer"]
