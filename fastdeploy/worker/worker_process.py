"""The worker process: owns the model and the KV cache, runs steps sent by the engine."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import traceback

import msgspec
import psutil
import zmq

from fastdeploy.common.config import EngineConfig
from fastdeploy.common.ipc import PeerDiedError, endpoint, recv_with_liveness, socket
from fastdeploy.common.launch_clock import seconds_since_launch
from fastdeploy.common.startup_heap import settle_collector
from fastdeploy.common.step_input import StepInput
from fastdeploy.worker.in_flight_step import InFlightStep
from fastdeploy.worker.launch import tp_init_file
from fastdeploy.worker.model_runner import ModelRunner
from fastdeploy.worker.step_output import encode_mask_bits

logger = logging.getLogger(__name__)

# Message kinds on the worker socket: the first part of every multipart message.
INFO = b"I"
FRAME = b"F"
ERROR = b"E"
# How long a worker that failed to start waits for its error message to reach the engine.
ERROR_FLUSH_MS = 5000
STEP = b"S"
SHUTDOWN = b"Q"


def _exit_when_gone(pid: int) -> None:
    """A follower blocked in a collective cannot notice its parent die; this thread does."""
    while psutil.pid_exists(pid):
        time.sleep(1.0)
    os._exit(1)


def run_follower(config: EngineConfig, directory: str, rank: int, parent_pid: int) -> None:
    """Entry point of tensor-parallel rank > 0: runs the forward passes rank 0 plans, until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s worker-tp{rank} %(levelname)s %(message)s")
    threading.Thread(target=_exit_when_gone, args=(parent_pid,), daemon=True).start()
    runner = ModelRunner(config, rank, tp_init_file(directory))
    settle_collector(f"worker-tp{rank}")
    while runner.follow():
        pass
    runner.shutdown()
    logger.info("tensor-parallel rank %d stopped", rank)


def run_worker(config: EngineConfig, ipc_dir: str, engine_pid: int) -> None:
    """Entry point of the worker process (spawned by the engine); tensor-parallel rank 0."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine decides when we stop
    logging.basicConfig(level=logging.INFO, format="%(asctime)s worker %(levelname)s %(message)s")
    logger.info("worker process up %.1f s after launch (imports)", seconds_since_launch())
    ctx = zmq.Context()
    sock = socket(ctx, zmq.PAIR, endpoint(ipc_dir, "worker"), bind=False)
    try:
        runner = ModelRunner(config, 0, tp_init_file(ipc_dir))
        settle_collector("worker")
        sock.send_multipart([INFO, msgspec.msgpack.encode(runner.info)])
    except Exception:
        sock.send_multipart([ERROR, traceback.format_exc().encode()])
        # The socket drops unsent messages on close (no linger): let the engine get this one, which
        # says why, before the process exits; the engine otherwise sees only that it is gone.
        sock.close(linger=ERROR_FLUSH_MS)
        ctx.term()
        raise
    decoder = msgspec.msgpack.Decoder(StepInput)
    encoder = msgspec.msgpack.Encoder()

    def send_frame(launched: InFlightStep) -> None:
        """Finish a launched step and send its frame (or its failure): one message per step."""
        if launched.replied:
            return
        launched.replied = True
        try:
            output = runner.finish(launched)
            output.wait_mask_ids()  # one message per step: the whole frame goes at once
        except Exception:
            logger.exception("step failed")
            sock.send_multipart([ERROR, traceback.format_exc().encode()])
            return
        sock.send_multipart([FRAME, output.frame, encoder.encode(output.events),
                             *encode_mask_bits(output.mask_bits)], copy=False)

    def reply(launched: InFlightStep) -> None:
        send_frame(launched)
        runner.after_frame()  # drafting for the next step, while the engine takes in this one

    # A step finished inside the next one's launch goes out at once; the engine takes it in
    # while this process fills the next step's bitmasks and launches its sampler.
    runner.on_finished_early = send_frame

    # A step sent `followed`: its frame goes out once the next step is launched behind it.
    owed: InFlightStep | None = None
    try:
        while True:
            try:
                kind, *payload = recv_with_liveness(sock, engine_pid, timeout_s=None)
            except PeerDiedError:
                logger.warning("engine process %d is gone; worker exits", engine_pid)
                break
            if kind == SHUTDOWN:
                break
            step: StepInput | None = None
            launched: InFlightStep | None = None
            failure = None
            try:
                step = decoder.decode(payload[0])
                launched = runner.launch(step)
            except Exception:
                logger.exception("step failed")
                failure = traceback.format_exc()
            if owed is not None:
                reply(owed)
                owed = None
            if launched is None or step is None:
                sock.send_multipart([ERROR, (failure or "no step").encode()])
            elif step.followed:
                owed = launched
            else:
                reply(launched)
    finally:
        runner.shutdown()
        sock.close()
        ctx.term()
        logger.info("worker %d stopped", os.getpid())
