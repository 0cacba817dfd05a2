"""Counting the host-device synchronisations of each worker step (CUDA's sync debug mode).

`torch.cuda.set_sync_debug_mode("warn")` makes PyTorch warn at every operation that waits
for the GPU (`.item()`, `.tolist()`, `nonzero()`, a copy from pageable memory such as
`torch.tensor(list, device="cuda")`); the warning names the Python line that called it. The
step's packed frame is copied by the packer op's own `cudaStreamSynchronize`, which that mode
does not see, so every step that packs counts one more.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from fastdeploy.worker.model_runner import ModelRunner
from fastdeploy.worker.step_input import StepInput

_SYNC_WARNING = "synchronizing CUDA operation"


@dataclass
class StepSyncs:
    """One `ModelRunner.execute` call."""

    batch: int  # sequences sampled in the step
    decode: bool  # every chunk is one sampled token
    sources: list[str] = field(default_factory=list)  # "file:line" of each synchronising call PyTorch saw

    @property
    def total(self) -> int:
        """Synchronisations of the step, the packer's copy of the frame included."""
        return len(self.sources) + (1 if self.batch else 0)


@contextmanager
def count_step_syncs(runner: ModelRunner) -> Iterator[list[StepSyncs]]:
    """Record a StepSyncs for every step `runner` executes inside the block (CUDA only)."""
    steps: list[StepSyncs] = []
    execute = runner.execute

    def counted(step: StepInput):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                result = execute(step)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        sampled = [c for c in step.chunks if c.sample]
        steps.append(StepSyncs(
            batch=len(sampled),
            decode=bool(step.chunks) and all(c.sample and len(c.token_ids) == 1 for c in step.chunks),
            sources=[f"{w.filename}:{w.lineno}" for w in caught if _SYNC_WARNING in str(w.message)],
        ))
        return result

    runner.execute = counted  # an instance attribute: the executor looks the method up per call
    try:
        yield steps
    finally:
        del runner.execute


def steady_decode(steps: list[StepSyncs], warmup: int = 2) -> list[StepSyncs]:
    """The decode steps after the first `warmup` (which may load ops and compile kernels)."""
    return [s for s in steps if s.decode][warmup:]
