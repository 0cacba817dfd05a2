"""The engine process: scheduler + token processor, between the API server and the worker."""

from __future__ import annotations

import logging
import signal
import time
import traceback

import msgspec
import zmq

from fastdeploy.common.config import EngineConfig
from fastdeploy.common.ipc import PeerWatch, endpoint, socket
from fastdeploy.common.launch_clock import seconds_since_launch
from fastdeploy.common.request import (
    AbortRequests,
    AddRequest,
    EngineDead,
    EngineInput,
    EngineOutputs,
    EngineReady,
    RequestDelta,
)
from fastdeploy.common.sampling_masks import encode_buffers
from fastdeploy.common.sampling_params import ParameterError
from fastdeploy.common.startup_heap import settle_collector
from fastdeploy.engine.engine_core import EngineCore
from fastdeploy.engine.executor import WorkerError, WorkerProcessExecutor
from fastdeploy.worker.launch import WorkerProcesses

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 50
GRAMMAR_POLL_MS = 5
GAUGE_INTERVAL_S = 1.0
STATS_LOG_INTERVAL_S = 10.0  # the engine's stats line while it has work


def run_engine(config: EngineConfig, ipc_dir: str, client_pid: int, in_address: str | None = None,
               out_address: str | None = None, workers: WorkerProcesses | None = None) -> None:
    """The engine process's work (entered through `engine_launch.run_engine_process`, spawned by
    the API server or by a Ray actor that hosts a data-parallel replica). Its request and output
    sockets bind `in_address` / `out_address`, by default ipc endpoints in `ipc_dir`, where its
    workers' sockets always are. `workers`: its worker processes, already started. It exits when
    the process `client_pid` does."""
    stopping = False

    def on_sigterm(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_sigterm)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the API server, which stops us
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(levelname)s %(message)s")
    logger.info("engine process up %.1f s after launch (imports)", seconds_since_launch())
    ctx = zmq.Context()
    in_sock = socket(ctx, zmq.PULL, in_address or endpoint(ipc_dir, "engine_in"), bind=True)
    out_sock = socket(ctx, zmq.PUSH, out_address or endpoint(ipc_dir, "engine_out"), bind=True)
    encoder = msgspec.msgpack.Encoder(enc_hook=encode_buffers)  # deltas' sampling masks
    executor = None
    try:
        try:
            executor = WorkerProcessExecutor(config, ipc_dir, workers=workers)
            core = EngineCore(config, executor)
        except Exception:
            out_sock.send(encoder.encode(EngineDead(traceback.format_exc())))
            return
        settle_collector("engine")
        worker_pid = executor.process.pid
        assert worker_pid is not None, "the worker process has started"
        out_sock.send(encoder.encode(EngineReady(core.limits, worker_pid)))
        _serve(core, in_sock, out_sock, encoder, client_pid, lambda: stopping)
    finally:
        if executor is not None:
            executor.shutdown()
        in_sock.close()
        out_sock.close()
        ctx.term()


def _serve(core: EngineCore, in_sock: zmq.Socket, out_sock: zmq.Socket, encoder: msgspec.msgpack.Encoder,
           client_pid: int, stopping) -> None:
    decoder = msgspec.msgpack.Decoder(EngineInput)
    client = PeerWatch(client_pid)
    last_sent = 0.0
    last_logged = time.monotonic()

    def send_outputs(deltas: list[RequestDelta]) -> None:
        nonlocal last_sent
        blocks = core.block_manager
        outputs = EngineOutputs(deltas, core.num_running, core.num_waiting, blocks.usage,
                                core.spec_stats if core.config.speculative is not None else None,
                                blocks.query_tokens, blocks.hit_tokens)
        out_sock.send(encoder.encode(outputs))
        last_sent = time.monotonic()

    while not stopping():
        deltas: list[RequestDelta] = []
        # Sequences that only wait for a grammar compile need a poll now and then, not a spin.
        busy = core.has_work() and not (core.num_running == 0 and core.waiting_for_grammar)
        timeout = 0 if busy else (GRAMMAR_POLL_MS if core.has_work() else IDLE_POLL_MS)
        while in_sock.poll(timeout):
            timeout = 0
            message = decoder.decode(in_sock.recv())
            if isinstance(message, AddRequest):
                try:
                    core.add_request(message.request)
                except ParameterError as exc:
                    deltas.append(RequestDelta(message.request.request_id, [], finish_reason="error", error=str(exc),
                                               error_status=400))
            elif isinstance(message, AbortRequests):
                deltas.extend(core.abort(message.request_ids))
        if not client.alive():
            logger.warning("API server %d is gone; engine exits", client_pid)
            return
        dead_message = None
        if core.has_work():
            try:
                deltas.extend(core.step(emit_early=send_outputs))
            except WorkerError as exc:
                # The client fails every open request when it reads EngineDead, and marks
                # itself unhealthy first, so those requests report 503 rather than 500.
                logger.error("%s", exc)
                dead_message = str(exc)
        if deltas or time.monotonic() - last_sent > GAUGE_INTERVAL_S:
            send_outputs(deltas)
        if dead_message is not None:
            out_sock.send(encoder.encode(EngineDead(dead_message)))
            return
        now = time.monotonic()
        if core.has_work() and now - last_logged > STATS_LOG_INTERVAL_S:
            _log_stats(core)
            last_logged = now


def _log_stats(core: EngineCore) -> None:
    blocks = core.block_manager
    hit_rate = f"{100 * blocks.hit_tokens / blocks.query_tokens:.1f}%" if blocks.query_tokens else "-"
    logger.info("running %d, waiting %d, KV blocks in use %.1f%%, prefix cache hit rate %s (%d of %d tokens)",
                core.num_running, core.num_waiting, 100 * blocks.usage, hit_rate, blocks.hit_tokens,
                blocks.query_tokens)
    if core.draft_policy is not None:
        logger.info("draft caps (best cap, tokens per sequence per second of each cap): %s",
                    core.draft_policy.describe())
