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
    ClientHello,
    EngineDead,
    EngineInput,
    EngineOutputs,
    EngineReady,
    RequestDelta,
)
from fastdeploy.common.sampling_masks import encode_buffers
from fastdeploy.common.sampling_params import ParameterError
from fastdeploy.common.startup_heap import settle_collector
from fastdeploy.engine.client_routes import ClientRoutes
from fastdeploy.engine.engine_core import EngineCore
from fastdeploy.engine.executor import WorkerError, WorkerProcessExecutor
from fastdeploy.worker.launch import WorkerProcesses

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 50
GRAMMAR_POLL_MS = 5
GAUGE_INTERVAL_S = 1.0
STATS_LOG_INTERVAL_S = 10.0  # the engine's stats line while it has work
# A failed start answers API processes' hellos this long, to tell them why, then exits.
FAILED_START_HELLO_WAIT_S = 3.0


class OutputSocket:
    """The engine's output side: a ROUTER socket that API processes connect to (each says
    `ClientHello` first), and where each request's outputs go (`ClientRoutes`)."""

    def __init__(self, sock: zmq.Socket, encoder: msgspec.msgpack.Encoder) -> None:
        self.sock = sock
        self.encoder = encoder
        self.routes = ClientRoutes()
        self._hello = msgspec.msgpack.Decoder(ClientHello)

    def answer_hellos(self, reply: EngineReady | EngineDead, timeout_ms: int = 0) -> None:
        """Register the API processes that said hello and send each `reply`; waits up to
        `timeout_ms` for the first."""
        while self.sock.poll(timeout_ms):
            timeout_ms = 0
            identity, payload = self.sock.recv_multipart()
            try:
                self._hello.decode(payload)
            except msgspec.DecodeError:
                logger.warning("ignored a message that is no hello on the output socket")
                continue
            self.routes.add_client(identity)
            self.sock.send_multipart([identity, self.encoder.encode(reply)])

    def send(self, client: bytes, message: EngineOutputs | EngineDead) -> None:
        self.sock.send_multipart([client, self.encoder.encode(message)])

    def broadcast(self, message: EngineOutputs | EngineDead) -> None:
        payload = self.encoder.encode(message)
        for client in self.routes.clients:
            self.sock.send_multipart([client, payload])


def run_engine(config: EngineConfig, ipc_dir: str, client_pid: int, in_address: str | None = None,
               out_address: str | None = None, workers: WorkerProcesses | None = None) -> None:
    """The engine process's work (entered through `engine_launch.run_engine_process`, spawned by
    the API server or the server's launcher, or by a Ray actor that hosts a data-parallel
    replica). Its request and output sockets bind `in_address` / `out_address`, by default ipc
    endpoints in `ipc_dir`, where its workers' sockets always are. `workers`: its worker
    processes, already started. It exits when the process `client_pid` does."""
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
    out_sock = socket(ctx, zmq.ROUTER, out_address or endpoint(ipc_dir, "engine_out"), bind=True)
    out = OutputSocket(out_sock, msgspec.msgpack.Encoder(enc_hook=encode_buffers))  # deltas' sampling masks
    executor = None
    try:
        try:
            executor = WorkerProcessExecutor(config, ipc_dir, workers=workers)
            core = EngineCore(config, executor)
        except Exception:
            # The API processes learn why from this answer to their hello: they connect while
            # the engine starts, so theirs are queued by now, or come within the wait.
            failed = EngineDead(traceback.format_exc())
            deadline = time.monotonic() + FAILED_START_HELLO_WAIT_S
            while time.monotonic() < deadline:
                out.answer_hellos(failed, timeout_ms=100)
            return
        settle_collector("engine")
        worker_pid = executor.process.pid
        assert worker_pid is not None, "the worker process has started"
        _serve(core, in_sock, out, EngineReady(core.limits, worker_pid), client_pid, lambda: stopping)
    finally:
        if executor is not None:
            executor.shutdown()
        in_sock.close()
        out_sock.close()
        ctx.term()


def _serve(core: EngineCore, in_sock: zmq.Socket, out: OutputSocket, ready: EngineReady, client_pid: int,
           stopping) -> None:
    decoder = msgspec.msgpack.Decoder(EngineInput)
    client = PeerWatch(client_pid)
    last_sent = 0.0
    last_logged = time.monotonic()

    def outputs(deltas: list[RequestDelta]) -> EngineOutputs:
        blocks = core.block_manager
        spec = core.spec_stats if core.config.speculative is not None else None
        return EngineOutputs(deltas, core.num_running, core.num_waiting, blocks.usage, spec, blocks.query_tokens,
                             blocks.hit_tokens)

    def send_outputs(deltas: list[RequestDelta]) -> None:
        nonlocal last_sent
        now = time.monotonic()
        per_client = out.routes.split(deltas)
        # Each API process hears of its own requests; all of them of the gauges, once a second.
        refresh = now - last_sent > GAUGE_INTERVAL_S
        for identity in out.routes.clients if refresh else list(per_client):
            out.send(identity, outputs(per_client.get(identity, [])))
        if refresh:
            last_sent = now

    while not stopping():
        out.answer_hellos(ready)
        deltas: list[RequestDelta] = []
        # Sequences that only wait for a grammar compile need a poll now and then, not a spin.
        busy = core.has_work() and not (core.num_running == 0 and core.waiting_for_grammar)
        timeout = 0 if busy else (GRAMMAR_POLL_MS if core.has_work() else IDLE_POLL_MS)
        while in_sock.poll(timeout):
            timeout = 0
            message = decoder.decode(in_sock.recv())
            if isinstance(message, AddRequest):
                request_id = message.request.request_id
                sender = message.client.encode()
                if not out.routes.claim(request_id, sender):
                    out.send(sender, outputs([RequestDelta(request_id, [], finish_reason="error", error_status=400,
                                                           error=f"request id {request_id!r} is already running")]))
                    continue
                try:
                    core.add_request(message.request)
                except ParameterError as exc:
                    deltas.append(RequestDelta(request_id, [], finish_reason="error", error=str(exc),
                                               error_status=400))
            elif isinstance(message, AbortRequests):
                deltas.extend(core.abort(message.request_ids))
        if not client.alive():
            logger.warning("process %d, which started this engine, is gone; engine exits", client_pid)
            return
        dead_message = None
        if core.has_work():
            try:
                deltas.extend(core.step(emit_early=send_outputs))
            except WorkerError as exc:
                # The clients fail every open request when they read EngineDead, and mark
                # themselves unhealthy first, so those requests report 503 rather than 500.
                logger.error("%s", exc)
                dead_message = str(exc)
        if deltas or time.monotonic() - last_sent > GAUGE_INTERVAL_S:
            send_outputs(deltas)
        if dead_message is not None:
            out.broadcast(EngineDead(dead_message))
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
