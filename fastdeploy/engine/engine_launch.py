"""The engine process's entry point, light on purpose: it starts the worker processes before it
imports the engine's own code, so the engine's imports and the workers' imports and model
loading happen at the same time instead of one after the other."""

from __future__ import annotations

from fastdeploy.common.config import EngineConfig
from fastdeploy.worker.launch import start_workers


def run_engine_process(config: EngineConfig, ipc_dir: str, client_pid: int, in_address: str | None = None,
                       out_address: str | None = None) -> None:
    """See `engine_process.run_engine`; this starts the workers first and hands them over."""
    workers = start_workers(config, ipc_dir)
    from fastdeploy.engine.engine_process import run_engine

    run_engine(config, ipc_dir, client_pid, in_address, out_address, workers=workers)
