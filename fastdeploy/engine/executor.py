"""Where steps run: in this process, or in a worker process over ZMQ."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import tempfile
from typing import Protocol

import msgspec
import zmq

from fastdeploy.config import EngineConfig
from fastdeploy.ipc import PeerDiedError, endpoint, recv_with_liveness, socket
from fastdeploy.worker.model_runner import ModelRunner, WorkerInfo
from fastdeploy.worker.step_input import StepInput, WorkerEvents
from fastdeploy.worker.step_output import StepOutput
from fastdeploy.worker.worker_process import FRAME, INFO, SHUTDOWN, STEP, run_worker, spawn_followers, tp_init_file


class Executor(Protocol):
    info: WorkerInfo

    def execute(self, step: StepInput) -> StepOutput:
        """Run one step; return its packed frame and its non-token events."""

    def shutdown(self) -> None: ...


class InProcessExecutor:
    """Offline use: the model runner lives in the caller's process (tensor-parallel rank 0;
    ranks 1..N-1 run in child processes)."""

    def __init__(self, config: EngineConfig) -> None:
        self._dir = tempfile.mkdtemp(prefix="fastdeploy-tp-") if config.tensor_parallel_size > 1 else None
        self.followers = spawn_followers(config, self._dir) if self._dir else []
        self.runner = ModelRunner(config, 0, tp_init_file(self._dir) if self._dir else None)
        self.info = self.runner.info

    def execute(self, step: StepInput) -> StepOutput:
        return self.runner.execute(step)

    def shutdown(self) -> None:
        self.runner.shutdown()  # with the followers, which leave the group as they stop
        for process in self.followers:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
        self.followers = []
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)


class WorkerError(RuntimeError):
    """The worker failed a step or died; in-flight sequences cannot continue."""


class WorkerProcessExecutor:
    """Serving: the model runner lives in a worker process reached over a ZMQ PAIR socket."""

    def __init__(self, config: EngineConfig, ipc_dir: str, startup_timeout_s: float = 600.0,
                 step_timeout_s: float = 600.0) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._events_decoder = msgspec.msgpack.Decoder(WorkerEvents)
        self.step_timeout_s = step_timeout_s
        self.ctx = zmq.Context()
        self.sock = socket(self.ctx, zmq.PAIR, endpoint(ipc_dir, "worker"), bind=True)
        spawn = multiprocessing.get_context("spawn")
        self.process = spawn.Process(target=run_worker, args=(config, ipc_dir, os.getpid()), daemon=True,
                                     name="fastdeploy-worker")
        self.process.start()
        self.followers = spawn_followers(config, ipc_dir)
        kind, payload = self._recv(startup_timeout_s)
        if kind != INFO:
            raise WorkerError(f"worker failed to start:\n{payload.decode()}")
        self.info = msgspec.msgpack.decode(payload, type=WorkerInfo)

    def _recv(self, timeout_s: float) -> list[bytes]:
        try:
            return recv_with_liveness(self.sock, self.process.pid, timeout_s)
        except (PeerDiedError, TimeoutError) as exc:
            raise WorkerError(f"worker process lost: {exc}") from exc

    def execute(self, step: StepInput) -> StepOutput:
        self.sock.send_multipart([STEP, self._encoder.encode(step)])
        kind, *payload = self._recv(self.step_timeout_s)
        if kind != FRAME:
            raise WorkerError(f"worker step failed:\n{payload[0].decode()}")
        return StepOutput(payload[0], self._events_decoder.decode(payload[1]))

    def shutdown(self) -> None:
        if self.process.is_alive():
            self.sock.send_multipart([SHUTDOWN])
            self.process.join(timeout=5)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(timeout=5)
        for process in self.followers:  # released by rank 0's shutdown; killed if rank 0 could not
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
        self.sock.close()
        self.ctx.term()
