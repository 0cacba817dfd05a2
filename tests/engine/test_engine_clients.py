"""Several API processes' clients on one engine (a server with `--api-server-count`): real engine
and worker processes of a small random Qwen2 on CPU, over the real ZMQ sockets. Each client gets
its own requests' tokens and nothing else; a request id already open on another client is
refused to the newcomer alone; a failed start tells every client why."""

from __future__ import annotations

import asyncio

from fastdeploy.common.config import CacheConfig, EngineConfig, SchedulerConfig
from fastdeploy.common.request import EngineRequest
from fastdeploy.common.sampling_params import SamplingParams
from fastdeploy.engine.engine_client import (
    AsyncEngineClient,
    EngineAddresses,
    EngineDeadError,
    LocalEngine,
    attached_client,
)
from tests.random_qwen2 import save_random_qwen2


def _config(model: str) -> EngineConfig:
    return EngineConfig(model=model, device="cpu", dtype="float32", guided_decoding_backend="off",
                        cache=CacheConfig(block_size=4, num_blocks=256),
                        scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=128, max_num_batched_tokens=128))


def _request(request_id: str, prompt: list[int], max_tokens: int = 12) -> EngineRequest:
    return EngineRequest(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))


async def _tokens(client: AsyncEngineClient, request: EngineRequest) -> tuple[list[int], str | None]:
    tokens: list[int] = []
    error = None
    async for delta in client.generate(request):
        tokens += delta.token_ids
        error = delta.error or error
    return tokens, error


def _attached(config: EngineConfig, engine: LocalEngine) -> AsyncEngineClient:
    return attached_client(config, EngineAddresses(engine.in_address, engine.out_address, engine.process.pid or 0))


def test_each_client_gets_its_own_requests_tokens(tmp_path):
    config = _config(save_random_qwen2(tmp_path / "qwen2", vocab_size=256))
    prompts = [[3 + i, 17, 40 + 2 * i, 9] for i in range(6)]

    async def main():
        engine = LocalEngine(config)
        clients = [_attached(config, engine) for _ in range(2)]
        try:
            await asyncio.gather(*(c.start() for c in clients))
            alone = [(await _tokens(clients[0], _request(f"a{i}", p)))[0] for i, p in enumerate(prompts)]
            # Both clients at once, their requests interleaved in the engine's batches.
            together = await asyncio.gather(*(_tokens(clients[i % 2], _request(f"t{i}", p))
                                              for i, p in enumerate(prompts)))
            # An id open on client 0 is refused to client 1, and client 0's request runs on.
            long: list[int] = []
            refused = None
            async for delta in clients[0].generate(_request("same", prompts[0], max_tokens=100)):
                long += delta.token_ids
                if refused is None:
                    refused = await _tokens(clients[1], _request("same", prompts[1]))
            return alone, together, refused, long
        finally:
            await asyncio.gather(*(c.shutdown() for c in clients))
            await engine.stop(10)

    alone, together, refused, long = asyncio.run(main())
    assert [t for t, _ in together] == alone and all(e is None for _, e in together)
    assert refused == ([], "request id 'same' is already running")
    assert len(long) == 100


def test_a_failed_start_tells_every_client_why(tmp_path):
    config = _config(str(tmp_path / "no-such-model"))

    async def main():
        engine = LocalEngine(config)
        clients = [_attached(config, engine) for _ in range(2)]
        try:
            return await asyncio.gather(*(c.start(startup_timeout_s=120) for c in clients), return_exceptions=True)
        finally:
            await asyncio.gather(*(c.shutdown() for c in clients))
            await engine.stop(10)

    for outcome in asyncio.run(main()):
        assert isinstance(outcome, EngineDeadError)
        # The engine's own traceback (its worker's error, or that the worker died loading the model).
        assert str(outcome).startswith("engine failed to start:\nTraceback"), str(outcome)
