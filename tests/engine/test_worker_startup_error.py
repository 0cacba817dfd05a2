"""A worker process that fails to start tells the engine why: the error it sends before it exits
reaches the engine (the socket would otherwise drop it as the process ends), and the engine
raises it instead of reporting only that the worker is gone."""

from __future__ import annotations

from pathlib import Path

import pytest

from fastdeploy.common.config import EngineConfig
from fastdeploy.common.ipc import make_ipc_dir
from fastdeploy.engine.executor import WorkerError, WorkerProcessExecutor


def test_a_worker_that_cannot_load_its_model_says_why(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    config = EngineConfig(model=str(missing), device="cpu", dtype="float32", guided_decoding_backend="off")
    with pytest.raises(WorkerError) as failure:
        WorkerProcessExecutor(config, make_ipc_dir(), startup_timeout_s=120)
    message = str(failure.value)
    assert message.startswith("worker failed to start"), message
    assert "no-such-model" in message, message
