"""Start the worker processes: rank 0 and the tensor-parallel ranks 1..N-1.

Light on purpose (no torch, no model code): the engine process starts its workers first
thing, and they import the model code while the engine imports its own.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.process
import os
from dataclasses import dataclass, field

from fastdeploy.common.config import EngineConfig
from fastdeploy.common.process_entry import run_target

_RUN_WORKER = "fastdeploy.worker.worker_process:run_worker"
_RUN_FOLLOWER = "fastdeploy.worker.worker_process:run_follower"


def tp_init_file(directory: str) -> str:
    """The file the tensor-parallel ranks rendezvous on (fresh per engine: in its private directory)."""
    return os.path.join(directory, "tp_init")


def spawn_followers(config: EngineConfig, directory: str) -> list[multiprocessing.process.BaseProcess]:
    """Start tensor-parallel ranks 1..N-1 as children of the caller (rank 0 is the caller itself, or
    its worker process: a daemonic worker may not have children of its own)."""
    spawn = multiprocessing.get_context("spawn")
    followers: list[multiprocessing.process.BaseProcess] = []
    for rank in range(1, config.tensor_parallel_size):
        process = spawn.Process(target=run_target, args=(_RUN_FOLLOWER, config, directory, rank, os.getpid()),
                                daemon=True, name=f"fastdeploy-worker-tp{rank}")
        process.start()
        followers.append(process)
    return followers


@dataclass
class WorkerProcesses:
    """The serving worker (rank 0, which the engine talks to over `ipc_dir`) and its followers."""

    rank0: multiprocessing.process.BaseProcess
    followers: list[multiprocessing.process.BaseProcess] = field(default_factory=list)


def start_workers(config: EngineConfig, ipc_dir: str) -> WorkerProcesses:
    """Spawn the worker processes of an engine whose ipc endpoints live in `ipc_dir`; they watch
    the calling process and exit when it does."""
    spawn = multiprocessing.get_context("spawn")
    rank0 = spawn.Process(target=run_target, args=(_RUN_WORKER, config, ipc_dir, os.getpid()), daemon=True,
                          name="fastdeploy-worker")
    rank0.start()
    return WorkerProcesses(rank0, spawn_followers(config, ipc_dir))
