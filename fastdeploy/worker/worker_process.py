"""The worker process: owns the model and the KV cache, runs steps sent by the engine."""

from __future__ import annotations

import logging
import os
import signal
import traceback

import msgspec
import zmq

from fastdeploy.config import EngineConfig
from fastdeploy.ipc import PeerDiedError, endpoint, recv_with_liveness, socket
from fastdeploy.worker.model_runner import ModelRunner
from fastdeploy.worker.step_input import StepInput

logger = logging.getLogger(__name__)

# Message kinds on the worker socket: the first part of every multipart message.
INFO = b"I"
FRAME = b"F"
ERROR = b"E"
STEP = b"S"
SHUTDOWN = b"Q"


def run_worker(config: EngineConfig, ipc_dir: str, engine_pid: int) -> None:
    """Entry point of the worker process (spawned by the engine)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine decides when we stop
    logging.basicConfig(level=logging.INFO, format="%(asctime)s worker %(levelname)s %(message)s")
    ctx = zmq.Context()
    sock = socket(ctx, zmq.PAIR, endpoint(ipc_dir, "worker"), bind=False)
    try:
        runner = ModelRunner(config)
        sock.send_multipart([INFO, msgspec.msgpack.encode(runner.info)])
    except Exception:
        sock.send_multipart([ERROR, traceback.format_exc().encode()])
        raise
    decoder = msgspec.msgpack.Decoder(StepInput)
    encoder = msgspec.msgpack.Encoder()
    try:
        while True:
            try:
                kind, *payload = recv_with_liveness(sock, engine_pid, timeout_s=None)
            except PeerDiedError:
                logger.warning("engine process %d is gone; worker exits", engine_pid)
                break
            if kind == SHUTDOWN:
                break
            try:
                frame, events = runner.execute(decoder.decode(payload[0]))
            except Exception:
                logger.exception("step failed")
                sock.send_multipart([ERROR, traceback.format_exc().encode()])
                continue
            sock.send_multipart([FRAME, frame, encoder.encode(events)], copy=False)
    finally:
        sock.close()
        ctx.term()
        logger.info("worker %d stopped", os.getpid())
