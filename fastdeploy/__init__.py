"""fastdeploy: an OpenAI-compatible LLM serving engine."""

import os

# libgomp busy-waits between parallel regions by default; when any other process holds
# a core, PyTorch's CPU kernels then stall for milliseconds per op (measured on a loaded
# 2-core host: 2.9 tok/s busy-waiting vs 11 tok/s passive at batch 1). Must be set
# before torch loads its OpenMP runtime; an explicit user setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from fastdeploy.common.sampling_params import SamplingParams  # noqa: E402
from fastdeploy.entrypoints.llm import LLM, CompletionOutput, RequestOutput  # noqa: E402

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
