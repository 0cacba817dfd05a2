"""A worker process that fails to start tells the engine why: the error it sends before it exits
reaches the engine (the socket would otherwise drop it as the process ends), and the engine
raises it instead of reporting only that the worker is gone; a tensor-parallel rank lost during
start-up ends the engine's wait at once."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from fastdeploy.common.config import EngineConfig
from fastdeploy.common.ipc import make_ipc_dir
from fastdeploy.engine.executor import WorkerError, WorkerProcessExecutor
from fastdeploy.worker.launch import start_workers
from tests.random_qwen2 import save_random_qwen2


def test_a_worker_that_cannot_load_its_model_says_why(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    config = EngineConfig(model=str(missing), device="cpu", dtype="float32", guided_decoding_backend="off")
    with pytest.raises(WorkerError) as failure:
        WorkerProcessExecutor(config, make_ipc_dir(), startup_timeout_s=120)
    message = str(failure.value)
    assert message.startswith("worker failed to start"), message
    assert "no-such-model" in message, message


def test_a_tensor_parallel_rank_that_exits_during_start_up_ends_the_wait(tmp_path: Path) -> None:
    """Rank 0 would wait for the lost rank to join the group until the group's own timeout
    (minutes); the engine sees the rank gone within about a second and stops rank 0 too."""
    model_dir = save_random_qwen2(tmp_path / "model", vocab_size=256)
    ipc_dir = make_ipc_dir()
    config = EngineConfig(model=model_dir, device="cpu", dtype="float32", tensor_parallel_size=2,
                          guided_decoding_backend="off")
    workers = start_workers(config, ipc_dir)
    try:
        workers.followers[0].kill()
        start = time.monotonic()
        with pytest.raises(WorkerError, match="tensor-parallel rank 1 exited"):
            WorkerProcessExecutor(config, ipc_dir, startup_timeout_s=120, workers=workers)
        assert time.monotonic() - start < 60
        workers.rank0.join(timeout=10)
        assert not workers.rank0.is_alive(), "rank 0 was left waiting for the group"
    finally:
        for process in (workers.rank0, *workers.followers):
            process.kill()


def test_an_in_process_rank_0_stops_waiting_for_a_rank_that_exits_during_start_up(tmp_path: Path,
                                                                                   monkeypatch) -> None:
    """Offline use runs rank 0 in the caller's process, where no engine can stop it: rank 0
    itself sees the lost rank at the group's first meeting point, raises, and stops the rest."""
    from fastdeploy.engine import executor as executor_module

    spawned: list = []
    real = executor_module.spawn_followers
    monkeypatch.setattr(executor_module, "spawn_followers",
                        lambda config, directory: _killed_first(real(config, directory), spawned))
    model_dir = save_random_qwen2(tmp_path / "model", vocab_size=256)
    config = EngineConfig(model=model_dir, device="cpu", dtype="float32", tensor_parallel_size=2,
                          guided_decoding_backend="off")
    start = time.monotonic()
    with pytest.raises(WorkerError, match="tensor-parallel rank 1 exited"):
        executor_module.InProcessExecutor(config)
    assert time.monotonic() - start < 60
    assert spawned and not any(process.is_alive() for process in spawned)


def _killed_first(followers: list, spawned: list) -> list:
    followers[0].kill()
    followers[0].join(timeout=10)
    spawned.extend(followers)
    return followers
