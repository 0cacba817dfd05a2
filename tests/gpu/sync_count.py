"""Counting the host-device synchronisations of each worker step (CUDA's sync debug mode).

`torch.cuda.set_sync_debug_mode("warn")` makes PyTorch warn at every operation that waits
for the GPU (`.item()`, `.tolist()`, `nonzero()`, a copy from pageable memory such as
`torch.tensor(list, device="cuda")`); the warning names the Python line that called it. The
step's packed frame is copied by the packer op's own `cudaStreamSynchronize`, which that mode
does not see, so every step that packs counts one more.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from fastdeploy.common.step_input import StepInput
from fastdeploy.worker.in_flight_step import InFlightStep
from fastdeploy.worker.model_runner import ModelRunner
from fastdeploy.worker.step_output import StepOutput

T = TypeVar("T")

_SYNC_WARNING = "synchronizing CUDA operation"


@dataclass
class StepSyncs:
    """One step of the runner: its launch and its result."""

    batch: int  # sequences sampled in the step
    decode: bool  # every chunk is one sampled token
    verifies: bool = False  # every chunk is a sampled decode row with draft rows after it
    sources: list[str] = field(default_factory=list)  # "file:line" of each synchronising call PyTorch saw

    @property
    def total(self) -> int:
        """Synchronisations of the step, the packer's copy of the frame included."""
        return len(self.sources) + (1 if self.batch else 0)


def _watched(call: Callable[[], T], sources: list[str]) -> T:
    """`call()` with PyTorch's sync debug mode on; the lines of the synchronising calls it saw go to `sources`."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            return call()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            sources += [f"{w.filename}:{w.lineno}" for w in caught if _SYNC_WARNING in str(w.message)]


@contextmanager
def count_step_syncs(runner: ModelRunner) -> Iterator[list[StepSyncs]]:
    """Record a StepSyncs for every step `runner` launches inside the block (CUDA only): its
    launch and its finish together, not what the caller does in between."""
    steps: list[StepSyncs] = []
    records: dict[int, StepSyncs] = {}  # id(handle) -> its step's record
    launch, finish = runner.launch, runner.finish

    def counted_launch(step: StepInput) -> InFlightStep:
        sampled = [c for c in step.chunks if c.sample]
        record = StepSyncs(
            batch=len(sampled),
            decode=bool(step.chunks) and all(c.sample and len(c.token_ids) == 1 for c in step.chunks),
            verifies=bool(step.chunks) and all(c.sample and len(c.token_ids) == 1 and c.num_lookahead > 0
                                               and c.start > 0 for c in step.chunks),
        )
        steps.append(record)
        handle = _watched(lambda: launch(step), record.sources)
        records[id(handle)] = record
        return handle

    def counted_finish(handle: InFlightStep) -> StepOutput:
        record = records.pop(id(handle))
        return _watched(lambda: finish(handle), record.sources)

    # Instance attributes: the executor and `execute` look the methods up per call.
    runner.launch = counted_launch  # type: ignore[method-assign]
    runner.finish = counted_finish  # type: ignore[method-assign]
    try:
        yield steps
    finally:
        del runner.launch, runner.finish


def steady_decode(steps: list[StepSyncs], warmup: int = 2) -> list[StepSyncs]:
    """The decode steps after the first `warmup` (which may load ops and compile kernels)."""
    return [s for s in steps if s.decode][warmup:]
