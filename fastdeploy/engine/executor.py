"""Where steps run: in this process, or in a worker process over ZMQ."""

from __future__ import annotations

from typing import Protocol

from fastdeploy.config import EngineConfig
from fastdeploy.worker.model_runner import ModelRunner, WorkerInfo
from fastdeploy.worker.step_input import StepInput


class Executor(Protocol):
    info: WorkerInfo

    def execute(self, step: StepInput) -> bytes:
        """Run one step; return its packed frame."""

    def shutdown(self) -> None: ...


class InProcessExecutor:
    """Offline use: the model runner lives in the caller's process."""

    def __init__(self, config: EngineConfig) -> None:
        self.runner = ModelRunner(config)
        self.info = self.runner.info

    def execute(self, step: StepInput) -> bytes:
        return self.runner.execute(step)

    def shutdown(self) -> None:
        pass
