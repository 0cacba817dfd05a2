"""Where steps run: in this process, or in a worker process over ZMQ."""

from __future__ import annotations

import functools
import shutil
import tempfile
import time
from multiprocessing.process import BaseProcess
from typing import Protocol

import msgspec
import zmq

from fastdeploy.common.config import EngineConfig
from fastdeploy.common.ipc import PeerDiedError, endpoint, recv_with_liveness, socket
from fastdeploy.common.step_input import StepInput, WorkerEvents
from fastdeploy.worker.in_flight_step import InFlightStep
from fastdeploy.worker.launch import WorkerProcesses, spawn_followers, start_workers, tp_init_file
from fastdeploy.worker.model_runner import ModelRunner, WorkerInfo
from fastdeploy.worker.step_output import StepOutput, decode_mask_bits
from fastdeploy.worker.worker_process import FRAME, INFO, SHUTDOWN, STEP


class PendingStep(Protocol):
    def result(self) -> StepOutput:
        """Wait for the step; its packed frame and its non-token events."""


class Executor(Protocol):
    info: WorkerInfo
    # Whether a submitted step runs while the engine's thread goes on (a worker process, or a
    # GPU's queue): only then is there time to spend between `submit` and `result`.
    runs_beside_engine: bool

    def submit(self, step: StepInput) -> PendingStep:
        """Start one step; each step's result is taken before the next is submitted."""

    def shutdown(self) -> None: ...


class LocalStep:
    """A step launched on this process's runner; `result()` finishes it (the step's one wait)."""

    def __init__(self, runner: ModelRunner, launched: InFlightStep) -> None:
        self._runner = runner
        self._launched = launched
        self._output: StepOutput | None = None

    def result(self) -> StepOutput:
        if self._output is None:
            self._output = self._runner.finish(self._launched)
        return self._output


class InProcessExecutor:
    """Offline use: the model runner lives in the caller's process (tensor-parallel rank 0;
    ranks 1..N-1 run in child processes)."""

    def __init__(self, config: EngineConfig) -> None:
        self._dir = tempfile.mkdtemp(prefix="fastdeploy-tp-") if config.tensor_parallel_size > 1 else None
        self.followers = spawn_followers(config, self._dir) if self._dir else []
        try:
            # Rank 0 runs here, so nothing outside can stop its wait for a lost rank: it looks itself.
            self.runner = ModelRunner(config, 0, tp_init_file(self._dir) if self._dir else None,
                                      check_ranks=functools.partial(raise_if_a_follower_exited, self.followers))
        except BaseException:
            self._stop_followers(grace_s=0.0)  # they wait for rank 0 in the group's set-up
            raise
        self.info = self.runner.info
        self.runs_beside_engine = self.runner.device.type == "cuda"

    def submit(self, step: StepInput) -> LocalStep:
        return LocalStep(self.runner, self.runner.launch(step))

    def shutdown(self) -> None:
        self.runner.shutdown()  # with the followers, which leave the group as they stop
        self._stop_followers(grace_s=5.0)

    def _stop_followers(self, grace_s: float) -> None:
        for process in self.followers:
            process.join(timeout=grace_s)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
        self.followers = []
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)


def raise_if_a_follower_exited(followers: list[BaseProcess]) -> None:
    """WorkerError naming the first tensor-parallel rank (1..N-1) of `followers` that has exited."""
    for rank, follower in enumerate(followers, start=1):
        if not follower.is_alive():
            raise WorkerError(f"worker failed to start: tensor-parallel rank {rank} exited (exit code "
                              f"{follower.exitcode}); its error is in the log above")


# How often the start-up wait looks at the tensor-parallel ranks beside rank 0.
FOLLOWER_CHECK_S = 1.0


class WorkerError(RuntimeError):
    """The worker failed a step or died; in-flight sequences cannot continue."""


class RemoteStep:
    """A step sent to the worker process; its frame is received by `result()`."""

    def __init__(self, executor: WorkerProcessExecutor) -> None:
        self._executor = executor
        self._output: StepOutput | None = None

    def result(self) -> StepOutput:
        if self._output is None:
            self._output = self._executor.receive_step()
        return self._output


class WorkerProcessExecutor:
    """Serving: the model runner lives in a worker process reached over a ZMQ PAIR socket."""

    def __init__(self, config: EngineConfig, ipc_dir: str, startup_timeout_s: float = 600.0,
                 step_timeout_s: float = 600.0, workers: WorkerProcesses | None = None) -> None:
        """`workers`: the worker processes when the caller started them already (they connect
        to the socket bound here whenever it appears); None starts them now."""
        self._encoder = msgspec.msgpack.Encoder()
        self._events_decoder = msgspec.msgpack.Decoder(WorkerEvents)
        self.step_timeout_s = step_timeout_s
        self.ctx = zmq.Context()
        self.sock = socket(self.ctx, zmq.PAIR, endpoint(ipc_dir, "worker"), bind=True)
        try:
            workers = workers or start_workers(config, ipc_dir)
            self.process, self.followers = workers.rank0, workers.followers
            kind, payload = self._receive_start(startup_timeout_s)
            if kind != INFO:
                raise WorkerError(f"worker failed to start:\n{payload.decode()}")
        except BaseException:
            # Nothing calls shutdown on an executor that never started: close its socket here
            # (a context collected with a socket still open blocks in its teardown).
            self.sock.close()
            self.ctx.term()
            raise
        self.info = msgspec.msgpack.decode(payload, type=WorkerInfo)
        self.runs_beside_engine = True

    def _receive_start(self, timeout_s: float) -> list[bytes]:
        """The worker's first message. A tensor-parallel rank that exits meanwhile ends the wait:
        rank 0 would wait for it to join the group until the group's own timeout."""
        deadline = time.monotonic() + timeout_s
        pid = self.process.pid
        assert pid is not None  # started before this
        while True:
            try:
                return recv_with_liveness(self.sock, pid, min(FOLLOWER_CHECK_S, max(0.0, deadline - time.monotonic())))
            except PeerDiedError as exc:
                raise WorkerError(f"worker process lost: {exc}") from exc
            except TimeoutError as exc:
                if time.monotonic() >= deadline:
                    raise WorkerError(f"worker process lost: no message in {timeout_s:.0f} s") from exc
            try:
                raise_if_a_follower_exited(self.followers)
            except WorkerError:
                for process in (self.process, *self.followers):  # rank 0 waits in the group's set-up
                    process.kill()
                raise

    def _recv(self, timeout_s: float) -> list[bytes]:
        try:
            pid = self.process.pid
            assert pid is not None  # started in __init__
            return recv_with_liveness(self.sock, pid, timeout_s)
        except (PeerDiedError, TimeoutError) as exc:
            raise WorkerError(f"worker process lost: {exc}") from exc

    def submit(self, step: StepInput) -> RemoteStep:
        self.sock.send_multipart([STEP, self._encoder.encode(step)])
        return RemoteStep(self)

    def receive_step(self) -> StepOutput:
        """The frame of the step sent last (bounded by `step_timeout_s` and the worker's liveness)."""
        kind, *payload = self._recv(self.step_timeout_s)
        if kind != FRAME:
            raise WorkerError(f"worker step failed:\n{payload[0].decode()}")
        return StepOutput(payload[0], self._events_decoder.decode(payload[1]),
                          mask_bits=decode_mask_bits(payload[2], payload[3]))

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
