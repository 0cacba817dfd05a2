"""A server with several API processes (`--api-server-count N`): this process (the launcher)
starts the engines (one per data-parallel replica) and N API processes that each listen on the
server's port (SO_REUSEPORT: the kernel hands each new connection to one of them) and all reach
every engine. Streaming is the API process's work (one socket write per chunk and stream); with
several, a server whose replicas outrun one API process is no longer capped by one core.

The launcher owns every process: when an API process or an engine exits, or on SIGTERM / Ctrl-C,
it stops the others and exits (non-zero unless it was asked to stop); an engine that dies is not
restarted here, as it is behind a single API process. Request counters and latencies are
summed over the API processes on /metrics (Prometheus' multiprocess mode); the engines' series
come from API process 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import tempfile
from collections.abc import Callable

from fastdeploy.common.config import EngineConfig
from fastdeploy.engine.engine_client import EngineAddresses, LocalEngine
from fastdeploy.engine.replicas import replica_devices

logger = logging.getLogger("fastdeploy.api_processes")

LISTEN_BACKLOG = 2048
STOP_TIMEOUT_S = 10.0
# Prometheus' multiprocess mode reads this at import, in every API process.
METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"

# The API process's entry: (args, engines, its index among the API processes).
ApiProcessMain = Callable[[argparse.Namespace, list[EngineAddresses], int], None]


def listening_socket(host: str, port: int, listen: bool = True) -> socket.socket:
    """A TCP socket bound to the server's address with SO_REUSEPORT: each API process listens on
    one of its own, and the kernel spreads new connections evenly over them (by a hash of the
    connection; one socket shared by all would let whichever process is polling take most)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    if listen:
        sock.listen(LISTEN_BACKLOG)
    return sock


def run_api_processes(args: argparse.Namespace, config: EngineConfig, api_main: ApiProcessMain) -> int:
    """Start the engines and `args.api_server_count` API processes running `api_main`; return
    the exit code once the server has stopped."""
    count = args.api_server_count
    replicas = args.data_parallel_size
    try:  # the address is free (or only held by sockets that share it): said here, not by N processes
        # Held (bound, not listening: it takes no connections) while the server runs, so that
        # `--port 0` picks one port for every API process.
        reserved = listening_socket(args.host, args.port, listen=False)
    except OSError as exc:
        raise SystemExit(f"fastdeploy serve: cannot listen on {args.host}:{args.port}: {exc}") from None
    args.port = reserved.getsockname()[1]
    metrics_dir = tempfile.mkdtemp(prefix="fastdeploy-metrics-")
    os.environ[METRICS_DIR_ENV] = metrics_dir  # the spawned API processes inherit it
    stopping = False

    def on_signal(*_: object) -> None:
        nonlocal stopping
        stopping = True

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    engines: list[LocalEngine] = []
    api: list[multiprocessing.process.BaseProcess] = []
    failed = None
    try:
        for i in range(replicas):
            engines.append(LocalEngine(config, visible_devices=replica_devices(config, i) if replicas > 1 else None))
        addresses = [EngineAddresses(e.in_address, e.out_address, e.process.pid or 0) for e in engines]
        spawn = multiprocessing.get_context("spawn")
        api = [spawn.Process(target=api_main, args=(args, addresses, i), name=f"fastdeploy-api-{i}")
               for i in range(count)]
        for process in api:
            process.start()
        logger.info("%d API processes on %s:%d, %d engine%s", count, args.host, args.port, replicas,
                    "s" if replicas > 1 else "")
        children = {p.sentinel: f"API process {i}" for i, p in enumerate(api)}
        children.update({e.process.sentinel: f"engine {i}" for i, e in enumerate(engines)})
        while not stopping:
            ended = multiprocessing.connection.wait(list(children), timeout=0.5)
            if ended:
                failed = children[ended[0]]  # type: ignore[index]
                logger.error("%s exited; stopping the server", failed)
                break
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _stop(api, engines)
        reserved.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)
    return 1 if failed is not None else 0


def _stop(api: list[multiprocessing.process.BaseProcess], engines: list[LocalEngine]) -> None:
    """API processes first (they finish their responses within uvicorn's graceful shutdown),
    then the engines; every wait bounded."""
    for process in api:
        if process.is_alive():
            process.terminate()
    for process in api:
        process.join(STOP_TIMEOUT_S)
        if process.is_alive():
            process.kill()
            process.join(STOP_TIMEOUT_S)

    async def stop_engines() -> None:
        await asyncio.gather(*(e.stop(STOP_TIMEOUT_S) for e in engines), return_exceptions=True)

    asyncio.run(stop_engines())
