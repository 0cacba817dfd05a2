"""The API server's side of the engine socket: submit requests, route deltas, watch health."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import os
import shutil
import threading
import time
from collections.abc import AsyncGenerator, Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import msgspec
import zmq
import zmq.asyncio

from fastdeploy.common.config import EngineConfig
from fastdeploy.common.ipc import endpoint, make_ipc_dir, process_alive, socket
from fastdeploy.common.limits import EngineLimits
from fastdeploy.common.request import (
    AbortRequests,
    AddRequest,
    ClientHello,
    EngineDead,
    EngineMessage,
    EngineOutputs,
    EngineReady,
    EngineRequest,
    RequestDelta,
)
from fastdeploy.common.spec_decode_stats import SpecDecodeStats
from fastdeploy.engine.delta_inbox import DeltaInbox
from fastdeploy.engine.engine_launch import run_engine_process

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    pass


@dataclass
class EngineStats:
    """What one engine (or data-parallel replica) reports for /metrics: gauges now, counters
    since the server started."""

    num_running: int
    num_waiting: int
    kv_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    spec_decode: SpecDecodeStats | None


_CLIENT_NUMBERS = itertools.count()

# The environment is the process's: data-parallel replicas start from several threads at once
# (one `asyncio.to_thread` each), and each must spawn its engine with its own devices.
_ENVIRONMENT_LOCK = threading.Lock()


@contextlib.contextmanager
def cuda_visible_devices(devices: str | None) -> Iterator[None]:
    """CUDA_VISIBLE_DEVICES set to `devices` while inside (a spawned process copies the
    environment); one thread at a time is inside."""
    if devices is None:
        yield
        return
    with _ENVIRONMENT_LOCK:
        saved = os.environ.get("CUDA_VISIBLE_DEVICES")
        os.environ["CUDA_VISIBLE_DEVICES"] = devices
        try:
            yield
        finally:
            if saved is None:
                del os.environ["CUDA_VISIBLE_DEVICES"]
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = saved


class EngineHandle(Protocol):
    """A running engine process, wherever it runs: the addresses its sockets bind, and its life."""

    in_address: str  # the engine PULLs requests here
    out_address: str  # and PUSHes its messages here
    pid: int | None  # the process id where it is local to this process's host

    def alive(self) -> bool: ...

    async def stop(self, timeout_s: float) -> None: ...


class EngineClient(Protocol):
    """What the API server uses of its engine: one `AsyncEngineClient`, or a `ReplicaSet` of them."""

    @property
    def config(self) -> EngineConfig: ...

    @property
    def healthy(self) -> bool: ...

    @property
    def dead_reason(self) -> str | None: ...

    @property
    def limits(self) -> EngineLimits | None: ...

    def replica_of(self, request_id: str) -> int | None: ...

    def engine_stats(self) -> list[tuple[int | None, EngineStats, bool]]: ...

    async def start(self) -> None: ...

    def generate(self, request: EngineRequest) -> AsyncGenerator[RequestDelta, None]: ...

    async def shutdown(self) -> None: ...


class LocalEngine:
    """The engine as a child process, reached over ipc sockets in a private (0700) directory."""

    def __init__(self, config: EngineConfig, visible_devices: str | None = None) -> None:
        """`visible_devices`: CUDA_VISIBLE_DEVICES of the engine and its workers (a data-parallel
        replica's own GPUs); None leaves the environment as it is."""
        self.ipc_dir = make_ipc_dir()
        self.in_address = endpoint(self.ipc_dir, "engine_in")
        self.out_address = endpoint(self.ipc_dir, "engine_out")
        spawn = multiprocessing.get_context("spawn")
        self.process = spawn.Process(target=run_engine_process, args=(config, self.ipc_dir, os.getpid()),
                                     name="fastdeploy-engine")
        with cuda_visible_devices(visible_devices):
            self.process.start()
        self.pid = self.process.pid

    def alive(self) -> bool:
        return self.process.is_alive()

    async def stop(self, timeout_s: float) -> None:
        if self.process.is_alive():
            self.process.terminate()
            await asyncio.to_thread(self.process.join, timeout_s)
            if self.process.is_alive():
                self.process.kill()
                await asyncio.to_thread(self.process.join, timeout_s)
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


@dataclass(frozen=True)
class EngineAddresses:
    """Where an engine that another process started listens, and its process id."""

    in_address: str
    out_address: str
    pid: int


class AttachedEngine:
    """`EngineHandle` of an engine started and owned by another process (the launcher of a
    server with several API processes): this process only connects to it, and never stops it."""

    def __init__(self, addresses: EngineAddresses) -> None:
        self.in_address = addresses.in_address
        self.out_address = addresses.out_address
        self.pid: int | None = addresses.pid

    def alive(self) -> bool:
        return self.pid is not None and process_alive(self.pid)

    async def stop(self, timeout_s: float) -> None:
        return None  # the launcher ends the engine with the server


def attached_client(config: EngineConfig, engine: EngineAddresses) -> AsyncEngineClient:
    """A client of an engine that another process started (`AttachedEngine`)."""
    return AsyncEngineClient(config, launch=lambda c: AttachedEngine(engine))


class AsyncEngineClient:
    def __init__(self, config: EngineConfig, launch: Callable[[EngineConfig], EngineHandle] = LocalEngine) -> None:
        """`launch` starts the engine process (a local child by default; a Ray actor's for a
        data-parallel replica placed by Ray) and returns its handle."""
        self.config = config
        self._launch = launch
        self.engine: EngineHandle | None = None
        self.limits: EngineLimits | None = None
        self.dead_reason: str | None = None
        self.num_running = 0
        self.num_waiting = 0
        self.kv_usage = 0.0
        self.spec_decode: SpecDecodeStats | None = None
        self.prefix_cache_queries = 0  # tokens since start
        self.prefix_cache_hits = 0
        self._inboxes: dict[str, DeltaInbox] = {}
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineMessage)
        self._output_task: asyncio.Task | None = None
        self.worker_pid: int | None = None
        # Unique among the clients of one engine: API processes of a server share its engines.
        self.client_id = f"{os.getpid()}.{next(_CLIENT_NUMBERS)}"
        self.ctx: zmq.asyncio.Context | None = None

    @property
    def healthy(self) -> bool:
        return self.dead_reason is None and self.limits is not None

    def replica_of(self, request_id: str) -> int | None:
        """The data-parallel replica serving a request: none here, one engine serves them all."""
        return None

    def engine_stats(self) -> list[tuple[int | None, EngineStats, bool]]:
        """(replica, its report, whether it serves) for each engine behind this client."""
        return [(None, EngineStats(self.num_running, self.num_waiting, self.kv_usage, self.prefix_cache_queries,
                                   self.prefix_cache_hits, self.spec_decode), self.healthy)]

    async def start(self, startup_timeout_s: float = 600.0) -> None:
        self.engine = await asyncio.to_thread(self._launch, self.config)
        self.ctx = zmq.asyncio.Context()
        self.in_sock = socket(self.ctx, zmq.PUSH, self.engine.in_address, bind=False)
        # The engine's output socket serves every API process: this one is known by its identity.
        self.out_sock = socket(self.ctx, zmq.DEALER, self.engine.out_address, bind=False,
                               identity=self.client_id.encode())
        try:
            await self.out_sock.send(self._encoder.encode(ClientHello(self.client_id)))
            await self._wait_ready(startup_timeout_s)
        except BaseException:
            self._close_sockets()  # a failed start leaves no socket open (a context with one never ends)
            raise
        self._output_task = asyncio.create_task(self._route_outputs())

    async def _wait_ready(self, startup_timeout_s: float) -> None:
        assert self.engine is not None
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if await self.out_sock.poll(200):
                message = self._decoder.decode(await self.out_sock.recv())
                if isinstance(message, EngineReady):
                    self.limits, self.worker_pid = message.limits, message.worker_pid
                    break
                if isinstance(message, EngineDead):
                    raise EngineDeadError(f"engine failed to start:\n{message.message}")
            if not self.engine.alive():
                raise EngineDeadError("engine process exited during start-up")
            if time.monotonic() > deadline:
                raise EngineDeadError(f"engine not ready after {startup_timeout_s:.0f} s")

    def _fail_all(self, reason: str) -> None:
        self.dead_reason = reason
        for request_id, inbox in self._inboxes.items():
            inbox.put(RequestDelta(request_id, [], finish_reason="error", error=reason))

    async def _route_outputs(self) -> None:
        engine = self.engine
        assert engine is not None, "started by start()"
        while self.dead_reason is None:
            if await self.out_sock.poll(100):
                message = self._decoder.decode(await self.out_sock.recv())
                if isinstance(message, EngineOutputs):
                    self.num_running, self.num_waiting = message.num_running, message.num_waiting
                    self.kv_usage = message.kv_usage
                    self.spec_decode = message.spec_decode
                    self.prefix_cache_queries = message.prefix_cache_queries
                    self.prefix_cache_hits = message.prefix_cache_hits
                    for delta in message.deltas:
                        inbox = self._inboxes.get(delta.request_id)
                        if inbox is not None:
                            inbox.put(delta)
                elif isinstance(message, EngineDead):
                    self._fail_all(f"engine stopped: {message.message}")
            elif not engine.alive():
                self._fail_all("engine process exited")

    async def generate(self, request: EngineRequest) -> AsyncGenerator[RequestDelta, None]:
        """Yield the request's deltas until it finishes; abort it if the caller stops listening.
        Deltas that arrived while the caller was busy come merged (`DeltaInbox`)."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        inbox = DeltaInbox()
        self._inboxes[request.request_id] = inbox
        finished = False
        try:
            await self.in_sock.send(self._encoder.encode(AddRequest(request, self.client_id)))
            while not finished:
                for delta in await inbox.take():
                    finished = delta.finish_reason is not None
                    yield delta
                    if finished:
                        break
        finally:
            del self._inboxes[request.request_id]
            if not finished and self.dead_reason is None:
                await self.abort([request.request_id])

    async def abort(self, request_ids: list[str]) -> None:
        await self.in_sock.send(self._encoder.encode(AbortRequests(request_ids)))

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        if self._output_task is not None:
            self._output_task.cancel()
        if self.engine is not None:
            await self.engine.stop(timeout_s)
        self._close_sockets()

    def _close_sockets(self) -> None:
        if self.ctx is not None:
            self.in_sock.close()
            self.out_sock.close()
            self.ctx.term()
            self.ctx = None
