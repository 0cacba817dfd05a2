"""The OpenAI-compatible HTTP server: `python -m fastdeploy.entrypoints.openai.api_server`."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from fastdeploy.common.config import EngineConfig
from fastdeploy.common.errors import ParameterError
from fastdeploy.common.launch_clock import seconds_since_launch
from fastdeploy.common.startup_heap import settle_collector
from fastdeploy.engine.args import EngineArgs
from fastdeploy.engine.engine_client import AsyncEngineClient, EngineAddresses, EngineClient, attached_client
from fastdeploy.engine.replicas import DATA_PARALLEL_BACKENDS, ReplicaSet
from fastdeploy.entrypoints.openai.api_key_guard import APIKeyGuard
from fastdeploy.entrypoints.openai.api_processes import listening_socket, run_api_processes
from fastdeploy.entrypoints.openai.body_guard import BodyGuard
from fastdeploy.entrypoints.openai.errors import APIError, bad_request, validation_message
from fastdeploy.entrypoints.openai.metrics import ServerMetrics
from fastdeploy.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from fastdeploy.entrypoints.openai.request_limits import TransportLimits
from fastdeploy.entrypoints.openai.serving_chat import OpenAIServingChat
from fastdeploy.entrypoints.openai.serving_completion import OpenAIServingCompletion

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger("fastdeploy.api_server")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
ENGINE_SERIES_INTERVAL_S = 1.0  # with several API processes: how often the engines' series are set


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastdeploy serve",
                                     description="Serve a model through an OpenAI-compatible HTTP API.")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=os.environ.get("FASTDEPLOY_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1 routes (or set FASTDEPLOY_API_KEY)")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="model name(s) clients use; default: the model file's stem")
    parser.add_argument("--log-level", default="info")
    TransportLimits.add_cli_args(parser)
    parser.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                        help="engine replicas behind this server, each with its own engine, workers and KV "
                             "pool; requests go to the replica with the fewest outstanding tokens")
    parser.add_argument("--data-parallel-backend", choices=list(DATA_PARALLEL_BACKENDS), default="mp",
                        help="mp: replicas as local processes (on CUDA, replica i on GPUs i*tp..i*tp+tp-1); ray: "
                             "replicas as Ray actors in a placement group (pip install ray)")
    parser.add_argument("--ray-address", default=None,
                        help="Ray cluster to place replicas on (default: RAY_ADDRESS, else a local Ray)")
    parser.add_argument("--api-server-count", type=int, default=1,
                        help="HTTP processes sharing the port, each reaching every engine replica: streaming "
                             "costs one socket write per chunk and stream, and one process's core caps a server "
                             "whose replicas outrun it (with more than 1, replicas run as local processes and a "
                             "replica that exits stops the server)")
    return EngineArgs.add_cli_args(parser)


def served_names(args: argparse.Namespace) -> list[str]:
    if args.served_model_name:
        return list(args.served_model_name)
    if args.model is None:
        return [DEFAULT_MODEL_NAME]
    return [os.path.splitext(os.path.basename(os.path.normpath(args.model)))[0]]


def _load_tokenizer(model: str | None, tokenizer: str | None) -> PreTrainedTokenizerBase:
    # Imported on first use: the model loader brings torch and transformers, which this process
    # loads while the engine process starts rather than before it.
    from fastdeploy.model_executor.model_loader import get_tokenizer

    return get_tokenizer(model, tokenizer)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    try:
        return EngineArgs.from_cli_args(args).create_engine_config()
    except ValueError as exc:  # flags that do not go together: a usage error, not a traceback
        raise SystemExit(f"fastdeploy serve: {exc}") from None


def _engine_client(args: argparse.Namespace, config: EngineConfig,
                   engines: list[EngineAddresses] | None) -> EngineClient:
    """The API process's way to its engines: started here, or (`engines`) by the launcher."""
    replicas = args.data_parallel_size
    if replicas > 1:
        return ReplicaSet(config, replicas, args.data_parallel_backend, args.ray_address, attached=engines)
    if engines is not None:
        return attached_client(config, engines[0])
    return AsyncEngineClient(config)


def build_app(args: argparse.Namespace, engines: list[EngineAddresses] | None = None,
              api_index: int = 0) -> FastAPI:
    """`engines`: the launcher started them and this is API process `api_index` of several."""
    transport_limits = TransportLimits.from_cli_args(args)
    config = engine_config(args)
    names = served_names(args)
    several = engines is not None
    metrics = ServerMetrics(replicas=args.data_parallel_size, multiprocess=several)
    client = _engine_client(args, config, engines)
    state: dict = {}

    async def refresh_engine_series() -> None:
        # Several API processes: a scrape reaches any of them, so the series are kept current
        # here instead of at each scrape.
        while True:
            await asyncio.sleep(ENGINE_SERIES_INTERVAL_S)
            for replica, stats, up in client.engine_stats():
                metrics.update_engine(stats, replica, up)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        # The tokenizer loads while the engine starts: neither waits for the other.
        tokenizer_load = asyncio.create_task(asyncio.to_thread(_load_tokenizer, args.model, args.tokenizer))
        try:
            await client.start()
        finally:
            tokenizer = await tokenizer_load
        state["chat"] = OpenAIServingChat(client, tokenizer, names, metrics)
        state["completion"] = OpenAIServingCompletion(client, tokenizer, names, metrics)
        settle_collector("api server")
        logger.info("serving %s on http://%s:%d (%.1f s after launch%s)", names[0], args.host, args.port,
                    seconds_since_launch(), f", API process {api_index}" if several else "")
        # One API process sets the engines' series (each would add their counters' growth again).
        refresh = asyncio.create_task(refresh_engine_series()) if several and api_index == 0 else None
        try:
            yield
        finally:
            if refresh is not None:
                refresh.cancel()
            await client.shutdown()

    app = FastAPI(title="fastdeploy", lifespan=lifespan)
    app.state.client = client

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc.errors())
        return APIError(400, message, "invalid_request_error", param).response()

    @app.exception_handler(ParameterError)
    async def parameter_error(_: Request, exc: ParameterError) -> JSONResponse:
        return bad_request(str(exc), exc.param).response()

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        # Unknown routes, wrong methods and bodies the framework cannot read, in the same shape.
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        response = APIError(exc.status_code, str(exc.detail), kind).response()
        response.headers.update(exc.headers or {})
        return response

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        # A bug, not bad input: logged with its traceback by the server, answered in the usual shape.
        return APIError(500, f"internal error: {type(exc).__name__}", "server_error").response()

    # Added before the API-key check, so it runs after it: a body is read only for a client with the key.
    app.add_middleware(BodyGuard, limits=transport_limits)
    if args.api_key:
        app.add_middleware(APIKeyGuard, api_key=args.api_key)

    @app.api_route("/health", methods=["GET", "HEAD"])  # load balancers probe with either
    async def health() -> Response:
        if client.healthy and getattr(client, "degraded", False):
            # Data parallelism: some replicas are down (and restarting); the rest serve.
            down = [replica for replica, _, up in client.engine_stats() if not up]
            return JSONResponse({"status": "degraded", "replicas_down": down}, status_code=200)
        if client.healthy:
            return Response(status_code=200)
        return APIError(503, f"engine unavailable: {client.dead_reason}", "service_unavailable").response()

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        if not several:
            for replica, stats, up in client.engine_stats():
                metrics.update_engine(stats, replica, up)
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        created = int(time.time())
        return {"object": "list", "data": [{"id": n, "object": "model", "created": created,
                                            "owned_by": "fastdeploy"} for n in names]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request):
        return await state["chat"].create(request, raw_request)

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw_request: Request):
        return await state["completion"].create(request, raw_request)

    return app


def run_server(args: argparse.Namespace) -> None:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.api_server_count < 1:
        raise SystemExit(f"fastdeploy serve: --api-server-count must be at least 1, got {args.api_server_count}")
    if args.api_server_count > 1:
        if args.data_parallel_size > 1 and args.data_parallel_backend != "mp":
            raise SystemExit("fastdeploy serve: --api-server-count > 1 runs the replicas as local processes; "
                             "use --data-parallel-backend mp")
        sys.exit(run_api_processes(args, engine_config(args), serve_api_process))
    uvicorn.run(build_app(args), host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=5)


def serve_api_process(args: argparse.Namespace, engines: list[EngineAddresses], index: int) -> None:
    """One of a server's API processes (spawned by the launcher, `api_processes.py`): listens on
    the server's port beside the others; ends with the launcher."""
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s %(name)s[api {index}] %(levelname)s %(message)s")
    launcher = os.getppid()

    def watch_launcher() -> None:
        while os.getppid() == launcher:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)  # uvicorn's graceful stop

    threading.Thread(target=watch_launcher, name="launcher-watch", daemon=True).start()
    config = uvicorn.Config(build_app(args, engines, index), log_level=args.log_level, timeout_graceful_shutdown=5)
    uvicorn.Server(config).run(sockets=[listening_socket(args.host, args.port)])


def main(argv: list[str] | None = None) -> None:
    run_server(make_parser().parse_args(argv))


if __name__ == "__main__":
    main()
