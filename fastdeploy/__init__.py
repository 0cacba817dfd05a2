"""fastdeploy: an OpenAI-compatible LLM serving engine."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

# libgomp busy-waits between parallel regions by default; when any other process holds
# a core, PyTorch's CPU kernels then stall for milliseconds per op (measured on a loaded
# 2-core host: 2.9 tok/s busy-waiting vs 11 tok/s passive at batch 1). Must be set
# before torch loads its OpenMP runtime; an explicit user setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# ...but a decode step runs a hundred short parallel regions back to back, and a thread put to
# sleep after each one wakes late for the next: a short spin first (in libgomp's loop turns)
# keeps the second core in the step. LLM single stream on a 2-core VM: 32-34 tok/s without,
# 35-52 with 30,000 (36-46 with 300,000).
os.environ.setdefault("GOMP_SPINCOUNT", "30000")

from fastdeploy.common.sampling_params import SamplingParams  # noqa: E402

if TYPE_CHECKING:
    from fastdeploy.entrypoints.llm import LLM, CompletionOutput, RequestOutput

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]

_OFFLINE = ("LLM", "RequestOutput", "CompletionOutput")


def __getattr__(name: str) -> Any:
    # The offline API loads torch and the model code on first use, not on `import fastdeploy`:
    # every process of the server imports this package, and the API server needs none of it.
    if name in _OFFLINE:
        from fastdeploy.entrypoints import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'fastdeploy' has no attribute {name!r}")
